"""Evaluation with lm-evaluation-harness (the ``eval`` extra): ``scoring`` (requests -> packed
rows -> log-likelihoods and greedy flags; JAX only), ``harness`` (``JaxLM``, the harness's
``LM``, registered as ``transformer_jax``) and ``local_tasks`` (task YAML over local JSONL files,
offline). The command is ``transformer-jax evaluate`` (``cli/evaluate.py``).
"""
