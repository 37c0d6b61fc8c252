"""Layer kinds of Gemma 2/3 and Qwen3 checkpoints whose ``config.json`` lacks ``layer_types``.

Older exports have no ``layer_types``: Gemma 2 then alternates local/global, Gemma 3 makes every
``sliding_window_pattern``-th layer global and Qwen3 slides layers i >= ``max_window_layers``.
Each case saves a tiny random transformers model with ``save_pretrained``, deletes
``layer_types`` from its ``config.json`` and loads it with ``hf.load``; the expected kinds are
the ones transformers' own config class rebuilds from that file (``AutoConfig``), so an
off-by-one in our rule fails.

Needs the ``hf`` extra (torch, transformers, safetensors); skipped without it.
"""

from __future__ import annotations

import json

import pytest
from helpers import random_hf_model

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformer_jax import hf  # noqa: E402  (needs the optional extra checked above)

SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
WINDOW = 4
HF_KIND = {"sliding_attention": "local", "full_attention": "global"}

#: (family, its config kwargs, keys written into config.json once layer_types is gone).
CASES = {
    "gemma2-4": ("gemma2", dict(num_hidden_layers=4, sliding_window=WINDOW), {}),
    "gemma3-pattern3": ("gemma3_text", dict(num_hidden_layers=5, sliding_window=WINDOW),
                        dict(sliding_window_pattern=3)),
    "gemma3-pattern2": ("gemma3_text", dict(num_hidden_layers=4, sliding_window=WINDOW),
                        dict(sliding_window_pattern=2)),
    "gemma3-default": ("gemma3_text", dict(num_hidden_layers=7, sliding_window=WINDOW), {}),
    "qwen3-mwl1": ("qwen3", dict(num_hidden_layers=3, use_sliding_window=True,
                                 sliding_window=WINDOW, max_window_layers=1), {}),
    "qwen3-mwl2": ("qwen3", dict(num_hidden_layers=4, use_sliding_window=True,
                                 sliding_window=WINDOW, max_window_layers=2), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_kinds_without_layer_types_follow_transformers(name, tmp_path):
    family, kwargs, extra = CASES[name]
    random_hf_model(family, **SIZES, **kwargs).save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    del saved["layer_types"]
    saved.pop("sliding_window_pattern", None)
    saved.update(extra)
    config_file.write_text(json.dumps(saved))

    # transformers' config class fills layer_types in from the same file by its own rule.
    rebuilt = transformers.AutoConfig.from_pretrained(tmp_path)
    expected = [HF_KIND[t] for t in rebuilt.layer_types]
    assert len(set(expected)) == 2, f"{name}: a uniform stack cannot show an off-by-one"

    config, _ = hf.load(tmp_path)
    assert list(config.layer_kinds()) == expected, name
    assert config.sliding_window == WINDOW
