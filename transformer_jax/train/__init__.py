"""Training: a run from its configuration to checkpoints (``run(model, train, data)``).

``config`` (the ``[train]`` and ``[data]`` tables), ``checks`` and ``memory`` (what is checked
before any data or compile), ``data``, ``step`` (``TrainState``, the pure init / train / eval
steps), ``loss``, ``optim``, ``validation``, ``log``, ``resume``, ``perf``, ``plot``, the
objectives (``context``: SFT; ``preference``: DPO, ORPO; ``grpo``), and ``run``, the loop.
"""
