"""``python -m transformer_jax.generate``: ``transformer-jax generate`` (``cli/generate.py``).

Importing this module binds the package attribute ``generate`` to it, so the module is callable
and forwards calls to the library's ``decode.generate``.
"""

import sys
import types
from typing import Any

from transformer_jax.cli.generate import main
from transformer_jax.decode.generation import GenerateResult, generate


class _CallableModule(types.ModuleType):
    """A module that calls ``decode.generate`` when called."""

    def __call__(self, *args: Any, **kwargs: Any) -> GenerateResult:
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
