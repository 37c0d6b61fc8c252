"""``python -m transformer_jax.generate``: ``transformer-jax generate`` (``cli/generate.py``).

``transformer_jax.generate`` is also the library's ``generate`` function, and importing this
module binds the package attribute to the module; so the module is made callable and forwards
calls to ``decode.generate``.
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
