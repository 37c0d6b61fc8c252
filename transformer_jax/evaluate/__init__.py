"""Evaluation with lm-evaluation-harness (the ``eval`` extra).

Modules:
  scoring  requests -> packed rows with segment ids -> log-likelihoods and greedy flags
  harness  ``JaxLM``: the harness's ``LM`` (registered as ``transformer_jax``)
  cli      ``transformer-jax evaluate --checkpoint PATH --tasks T1,T2 ...``
  local_tasks  task YAML over local JSONL files (offline)

``scoring`` and ``local_tasks`` need only JAX / the standard library; ``harness`` and ``cli``
import ``lm_eval``.
"""
