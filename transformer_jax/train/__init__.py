"""Training: a run from its configuration to checkpoints.

``config`` (``TrainConfig``, ``DataConfig``, presets and typed overrides; ``config_docs`` turns
their docstrings into ``--help``), ``checks`` (what is checked before any data or compile) and
``memory`` (will it fit), ``data`` (the run's batches), ``init_from`` (a run started from a
checkpoint), ``loss`` and ``optim`` (masked cross-entropy, AdamW and its schedule), ``step``
(``TrainState`` and the pure init / train / eval steps), ``quant`` (quantised training),
``validation`` (validation loss and samples), ``log`` (metrics, TensorBoard, signals), ``resume``
(what a run must share with its checkpoints), ``perf`` (FLOPs, MFU), ``plot`` (loss curves) and
the objectives (``objective``: their keys; ``context``: SFT and their interface; ``preference``:
DPO, ORPO; ``grpo``, ``grpo_data``); ``run`` drives them in one loop: ``run(model, train, data)``.
"""
