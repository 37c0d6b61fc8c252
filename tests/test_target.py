"""``model.ops.target``: kernel and layout choices follow the platform a program is traced for
(a mesh's devices', or ``targeting``'s), not the process's default backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.decode import loop as decode
from transformer_jax.model.kv_cache import slots_last_for
from transformer_jax.model.ops import attention, moe, target
from transformer_jax.parallel import mesh as meshes
from transformer_jax.parallel import sharding


def _choices() -> dict:
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    k = jnp.zeros((1, 2, 128, 64), jnp.bfloat16)
    return dict(platform=target.platform(), attention=attention.choose_impl(q, k),
                moe=moe.choose_impl("auto", 64, 2, 8, widths=(128, 256)),
                slots_last=slots_last_for(), prepared=decode.target_platform())


def test_choices_follow_the_target_not_the_default_backend():
    assert jax.default_backend() == "cpu"
    here = _choices()
    assert here == dict(platform="cpu", attention="xla", moe="tiled", slots_last=True,
                        prepared="cpu")
    with target.targeting("tpu"):
        tpu = _choices()
    # attention: tokamax's kernel, or JAX's Pallas TPU kernel where tokamax is not installed.
    kernel = "mosaic" if attention._have_tokamax() else "pallas"
    assert tpu == dict(platform="tpu", attention=kernel, moe="megablox", slots_last=False,
                       prepared="tpu")
    with target.targeting("gpu"):
        assert _choices()["attention"] == "cudnn" and not slots_last_for()
    assert _choices() == here  # the context ends with its block
    with pytest.raises(ValueError, match="platform must be one of"), target.targeting("xpu"):
        pass


def test_a_sharded_jit_traces_for_its_meshs_platform():
    mesh = meshes.make_mesh(meshes.MeshConfig(data=1, fsdp=1, tensor=1),
                              devices=jax.devices()[:1])
    seen = []

    def f(x):
        seen.append(target.platform())
        return x * 2

    step = sharding.jit_sharded(f, mesh, NamedSharding(mesh, P()), NamedSharding(mesh, P()))
    with target.targeting("tpu"):  # the mesh's devices decide, whatever is in force around
        np.testing.assert_array_equal(step(jnp.ones(3)), 2 * np.ones(3))
    assert seen == ["cpu"]


def test_mesh_axes_are_a_rules_split_axes_when_they_divide_and_are_not_manual():
    auto, manual = AxisType.Explicit, AxisType.Manual
    mesh = AbstractMesh((2, 1, 2, 4), ("data", "fsdp", "expert", "tensor"),
                        axis_types=(auto, auto, auto, manual))
    assert target.mesh_axes(mesh, ("data", "fsdp", "expert"), 4) == ("data", "expert")
    assert target.mesh_axes(mesh, "data") == ("data",)
    assert target.mesh_axes(mesh, ("data", "expert"), 6) == ()  # 2 x 2 does not divide 6
    assert target.mesh_axes(mesh, ("data", "tensor")) == ()  # inside a shard_map over tensor
    assert target.mesh_axes(mesh, None) == target.mesh_axes(mesh, "context") == ()
