"""The train step (and generate, ``--serve``) compiled by the real TPU compiler for TPU
topologies, on this CPU host (``transformer-jax compile``): memory per chip, the collectives a
mesh implies, slices, errors.

Needs libtpu (the ``tpu`` extra, installed by the README's test command); the rest of the suite
does not. Every compile is of a 2-layer toy model, shared by module-scoped fixtures.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re

import numpy as np
import pytest

# Several processes (pytest-xdist workers, two compiles) may load libtpu at once: it compiles
# here and never claims a chip, so its one-process lock is not needed.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from transformer_jax.cli import compile as compile_cli  # noqa: E402
from transformer_jax.cli import compile_serve  # noqa: E402
from transformer_jax.parallel import collectives as coll  # noqa: E402
from transformer_jax.parallel import mesh as mesh_lib  # noqa: E402

TOY = ["model.vocab_size=256", "model.d_model=128", "model.d_ff=128", "model.n_layers=2",
       "model.n_heads=4", "model.n_kv_heads=4", "model.head_dim=128", "model.scan_layers=true",
       "model.attention_impl=xla", "train.batch_size=8", "train.seq_len=128"]
# The TPU compiler's time grows with the shapes: each fixture compiles the smallest batch and
# sequence its checks allow. The attention kernels' blocks are 128 positions (T = 128), their
# meshes split a batch of 4; the two-slice meshes (8 chips, attention "xla") need a batch of 8
# and no more than 32 positions.
KERNEL_SHAPES = ("train.batch_size=4",)
SLICE_SHAPES = ("train.seq_len=32",)


# The kernel meshes' attention inputs, q [B, T, N, H] (K = N).
B, T, N, H = 4, 128, 4, 128


def _report(topology: str, *extra: str, slices: int = 1) -> dict:
    return compile_cli.compile_report("tiny", [*TOY, *extra], topology, slices, hlo=True)


# ``train.loss_chunk``: the toy's head untied (a [D, V] = [128, 256] matrix of its own), T = 128
# in chunks of 32 positions: 4 chunks, 2 layers. fsdp4 compiles it (and data4 too, so that their
# states compare like for like); the other meshes compile the whole-logits loss.
LOSS_CHUNKS, LOSS_LAYERS = 4, 2
LOSS_CHUNKED = ("train.loss_chunk=32", "model.tie_embeddings=false")


# The single-slice meshes run the TPU attention kernels: "auto" (tokamax's "mosaic", or JAX's
# Pallas TPU kernel without tokamax) and "pallas", each per device over its split.
@pytest.fixture(scope="module")
def fsdp4():
    # train.mesh unset: fsdp=4.
    return _report("v5e:2x2", "model.attention_impl=auto", *LOSS_CHUNKED, *KERNEL_SHAPES)


@pytest.fixture(scope="module")
def data4():
    return _report("v5e:2x2", "train.mesh=4,1,1", "model.attention_impl=pallas", *LOSS_CHUNKED,
                   *KERNEL_SHAPES)


@pytest.fixture(scope="module")
def tensor4():
    return _report("v5e:2x2", "train.mesh=1,1,4", "model.attention_impl=pallas", *KERNEL_SHAPES)


@pytest.fixture(scope="module")
def data2_tensor2():
    return _report("v5e:2x2", "train.mesh=2,1,2", "model.attention_impl=pallas", *KERNEL_SHAPES)


@pytest.fixture(scope="module")
def two_slices():
    return _report("v5e:2x2", *SLICE_SHAPES, slices=2)


@pytest.fixture(scope="module")
def fsdp_over_slices():
    return _report("v5e:2x2", "train.dcn_mesh=fsdp=2", *SLICE_SHAPES, slices=2)


def _axes(report: dict) -> set[str]:
    return {key.split(" over ")[1] for key in report["collectives"]["by_axis"]}


def _kinds(report: dict) -> set[str]:
    return set(report["collectives"]["by_kind"])


@pytest.mark.parametrize("name", ["fsdp4", "data4", "tensor4", "data2_tensor2", "two_slices",
                                  "fsdp_over_slices"])
def test_memory_figures_are_consistent(name, request):
    r = request.getfixturevalue(name)
    m = r["memory"]
    assert r["fits"] and r["target"] == "tpu" and r["device_kind"] == "TPU v5 lite"
    assert r["hbm_bytes"] == 16 * 2**30
    assert min(m["argument"], m["output"]) > 0 and m["alias"] <= m["output"]
    assert 0 < m["peak"] <= r["hbm_bytes"]
    assert m["peak"] >= m["argument"] + m["temp"] - 1


def _all_gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    shapes = []
    for line in hlo.splitlines():
        if m := re.search(r"= (.*?) all-gather(?:-start)?\(", line):
            shapes += [tuple(int(d) for d in dims.split(",") if d)
                       for dims in re.findall(r"\[([\d,]*)\]", m.group(1))]
    return shapes


@pytest.mark.parametrize("name", ["fsdp4", "data4", "tensor4", "data2_tensor2"])
def test_attention_kernels_run_per_device_on_their_split_inputs(name, request):
    r = request.getfixturevalue(name)
    assert r["attention"] in ("auto", "pallas")
    # The scanned layer's body: the flash forward and its two backward kernels (dq, dk/dv).
    assert r["mosaic_calls"] >= 3
    gathered = _all_gathered_shapes(r["hlo"])
    if r["mesh"]["fsdp"] == 1:  # data and tensor splits gather nothing, q/k/v included
        assert gathered == []
    else:  # fsdp gathers weights only; q, k or v gathered whole would be [B, T, N, H]
        assert gathered and max(math.prod(s) for s in gathered) < B * T * N * H, gathered


def test_fsdp_splits_the_state_data_replicates_it(fsdp4, data4):
    # Parameters, Adam's moments and step: fsdp=4 holds about a quarter of each on a chip
    # (small replicated leaves, e.g. norm scales, keep it a little above).
    ratio = fsdp4["memory"]["argument"] / data4["memory"]["argument"]
    assert 0.24 <= ratio <= 0.35, ratio


def test_fsdp_gathers_weights_and_reduces_gradients_over_fsdp(fsdp4):
    assert _axes(fsdp4) == {"fsdp"}
    kinds = fsdp4["collectives"]["by_kind"]
    assert kinds["all-gather"]["count"] >= 2 * 4  # each layer's weights, forward and backward
    assert {"reduce-scatter", "all-reduce"} & set(kinds)  # the gradients' reduction


def test_data_parallel_only_reduces_gradients(data4):
    assert _axes(data4) == {"data"}
    assert "all-gather" not in _kinds(data4)
    # The reduced gradients are the parameters' size (float32), a third of params + mu + nu.
    reduced = data4["collectives"]["by_kind"]["all-reduce"]["bytes"]
    assert 0.25 <= reduced / data4["memory"]["argument"] <= 0.45


def test_tensor_parallel_all_reduces_over_tensor(tensor4):
    assert _axes(tensor4) == {"tensor"}
    # Per layer: the attention and MLP outputs forward, their inputs' gradients backward.
    assert tensor4["collectives"]["by_kind"]["all-reduce"]["count"] >= 2 * 2 * 2


def test_two_slices_cross_only_for_data_parallel_reductions(two_slices):
    assert two_slices["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    c = two_slices["collectives"]
    crossing = c["cross_slice"]
    assert set(crossing) <= {"all-reduce", "all-gather"} and "all-reduce" in crossing
    # ICI collectives stay within a slice, over fsdp: the same weight gathers as one slice.
    assert {k.split(" over ")[1] for k in c["by_axis"]} == {"fsdp", "data (dcn)"}
    ici = {k: v for k, v in c["by_axis"].items() if "dcn" not in k}
    assert ici["all-gather over fsdp"]["count"] >= 2 * 2  # each layer's weights, both passes
    # Over DCN: the fsdp-sharded gradients (a third of params + mu + nu per chip).
    dcn = crossing["all-reduce"]["bytes"] + crossing.get("all-gather", {"bytes": 0})["bytes"]
    assert 0.25 <= dcn / two_slices["memory"]["argument"] <= 0.45


def test_fsdp_over_slices_crosses_slices_for_fsdp_collectives(fsdp_over_slices, two_slices):
    r = fsdp_over_slices
    # The unset mesh: fsdp over every chip; train.dcn_mesh puts the two slices on it.
    assert r["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert r["dcn_mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    assert two_slices["dcn_mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
    crossing = r["collectives"]["cross_slice"]
    by_axis = r["collectives"]["by_axis"]
    assert {k.split(" over ")[1] for k in by_axis} == {"fsdp", "fsdp (dcn)"}
    # The weight gathers now cross slices (each layer's weights, both passes), where over
    # data only the gradient reductions did (and no gather as often).
    assert crossing["all-gather"]["count"] >= 2 * 2
    assert crossing["all-gather"]["count"] > two_slices["collectives"]["cross_slice"].get(
        "all-gather", {"count": 0})["count"]
    assert not any("fsdp (dcn)" in k for k in two_slices["collectives"]["by_axis"])
    # The parameters and optimizer state split 8 ways instead of 4.
    assert r["memory"]["argument"] < 0.6 * two_slices["memory"]["argument"]


def _devices(n: int, slices: int) -> list:
    """Fake devices of ``slices`` slices (only ``slice_index`` is read before the mesh)."""
    return [type("D", (), {"slice_index": i * slices // n})() for i in range(n)]


@pytest.mark.parametrize(("mesh", "dcn", "slices"), [
    ("1,16,1", "fsdp=2", 2), ("-1,1,1", "-1,1,1", 4), ("2,2,2,2", "1,2,1,2", 4),
    ("-1,2,1", "data=2,fsdp=2", 4), ("-1,1,1", "-1,1,1", 1)])
def test_hybrid_sizes_split_each_axis_into_ici_and_dcn(mesh, dcn, slices):
    config, dcn_config = mesh_lib.MeshConfig.parse(mesh), mesh_lib.MeshConfig.parse(dcn)
    ici, over = mesh_lib.hybrid_sizes(config, dcn_config, 16, slices)
    whole = config.resolve(16)
    assert tuple(i * d for i, d in zip(ici, over, strict=True)) == whole
    assert math.prod(over) == slices and math.prod(ici) == 16 // slices
    assert mesh_lib.slice_count(_devices(16, slices)) == slices


@pytest.mark.parametrize(("mesh", "dcn", "match"), [
    ("1,8,1", "2,2,1", "multiply to the slice count"), ("1,8,1", "3,-1,1", "multiply"),
    ("-1,1,1", "1,1,2", "tensor=1 cannot span 2 slices"),
    ("1,-1,1", "expert=2,data=-1", "expert axis"), ("3,1,1", "-1,1,1", "needs 3 devices")])
def test_bad_dcn_meshes_are_one_clear_error(mesh, dcn, match):
    config, dcn_config = mesh_lib.MeshConfig.parse(mesh), mesh_lib.MeshConfig.parse(dcn)
    with pytest.raises(ValueError, match=match):
        mesh_lib.make_mesh(config, _devices(8, 2), dcn_config)


def test_dcn_mesh_on_one_slice_or_in_a_config_is_checked():
    with pytest.raises(ValueError, match=r"dcn_mesh data=2 x .* 1 slice\(s\)"):
        mesh_lib.make_mesh(mesh_lib.MeshConfig(), _devices(8, 1)[:1],
                           mesh_lib.MeshConfig.parse("2,1,1"))
    from transformer_jax.train.config import TrainConfig

    with pytest.raises(ValueError, match="'1,x,1' must be integer"):
        TrainConfig(dcn_mesh="1,x,1")


def test_chunked_loss_reduces_the_heads_gradient_once_not_per_chunk(fsdp4):
    r = fsdp4  # train.loss_chunk=32 (LOSS_CHUNKED), an untied head
    assert r["fits"] and r["mesh"]["fsdp"] == 4
    found = coll.collectives(r["hlo"], np.arange(4).reshape(1, 4, 1), ("data", "fsdp", "tensor"))
    # Nothing runs once a chunk: each collective once a step or once a layer (the scanned stack).
    assert max(f["count"] for f in found) <= LOSS_LAYERS < LOSS_CHUNKS, sorted(
        (f["count"], f["kind"]) for f in found)
    # The head's float32 gradient, summed over the chunks on each chip, is reduced once.
    lines = {m.group(1): line for line in r["hlo"].splitlines()
             if (m := re.match(r"\s*(?:ROOT )?%([\w.-]+) = ", line))}
    head = [f for f in found if f["kind"] in ("all-reduce", "reduce-scatter")
            and "f32[128,256]" in lines[f["name"]]]
    assert sum(f["count"] for f in head) == 1, head


def test_cli_overflow_is_one_line(capsys):
    code = compile_cli.main(["--topology", "v5e:2x2", *TOY, "train.batch_size=512",
                             "train.seq_len=2048", "model.max_seq_len=2048",
                             "model.vocab_size=32768"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == compile_cli.EXIT_DOES_NOT_FIT
    assert err.startswith("error: does not fit on v5e:2x2") and "RESOURCE_EXHAUSTED" in err


@pytest.mark.parametrize("argv", [["--topology", "v9x:2x2"], ["--topology", "nonsense"],
                                  ["--topology", "v5e:2x2", "train.mesh=3,1,1"],
                                  ["--topology", "v5e:2x2", "--slices", "2",
                                   "train.dcn_mesh=1,1,2"]])
def test_cli_bad_input_is_one_line(argv, capsys):
    assert compile_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "Traceback" not in "".join(err)


def test_attention_auto_picks_the_tpu_kernel_for_a_tpu_mesh():
    import jax
    import jax.numpy as jnp

    from transformer_jax.model.ops import target
    from transformer_jax.model.ops.attention import choose_impl
    from transformer_jax.parallel import pod
    from transformer_jax.parallel.mesh import MeshConfig

    mesh = pod.pod_mesh(MeshConfig(1, 4, 1), pod.topology_devices("v5e:2x2"))
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 4, 256, 64), jnp.bfloat16)
    with target.targeting(target.of_mesh(mesh)):
        assert choose_impl(q, k) in ("mosaic", "pallas")  # "pallas" without tokamax
    assert choose_impl(q, k) not in ("mosaic", "pallas")  # this process's backend is the CPU


# ----------------------------------------------------- the HLO reading, on hand-made programs


def test_replica_group_forms_name_the_mesh_axes():
    ids = np.arange(8).reshape(2, 2, 2)
    names = ("data", "fsdp", "tensor")
    # data pairs i with i + 4, fsdp i with i + 2, tensor i with i + 1 (row-major ids).
    assert coll.mesh_axes_of(coll.parse_groups("{{0,4},{1,5},{2,6},{3,7}}", 8), ids,
                             names) == "data"
    assert coll.mesh_axes_of(coll.parse_groups("[4,2]<=[2,2,2]T(0,2,1)", 8), ids,
                             names) == "fsdp"
    assert coll.mesh_axes_of(coll.parse_groups("[2,4]<=[8]", 8), ids, names) == "fsdp+tensor"
    assert coll.mesh_axes_of(coll.parse_groups("{}", 8), ids, names) == "data+fsdp+tensor"
    assert coll.mesh_axes_of(coll.parse_groups(
        "mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", 8), ids, names) == "data"
    assert coll.mesh_axes_of([[0, 3], [1, 2], [4, 7], [5, 6]], ids, names) == "other"
    assert coll.pair_axes("{{0,1},{1,0},{2,3},{3,2}}", ids, names) == "tensor"


HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %g = f32[32]{0} all-gather(%x), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %x)
}

%all-reduce-scatter.1 (a: f32[32]) -> f32[8] {
  %a = f32[32]{0} parameter(0)
  %r = f32[32]{0} all-reduce(%a), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %s = f32[8]{0} dynamic-slice(%r, %o), dynamic_slice_sizes={8}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %f = f32[8]{0} fusion(%y), kind=kCustom, calls=%all-reduce-scatter.1
  %s = (bf16[4,8]{1,0}, u32[], token[]) send(%z, %t), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="all-reduce.7_0",_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %o = f32[8]{0} add(%f, %f)
}
"""  # noqa: E501 (HLO lines as the compiler writes them)


def test_loop_bodies_count_per_trip_and_fusions_name_reduce_scatters():
    found = coll.summarize(coll.collectives(HLO, np.arange(4).reshape(1, 4, 1),
                                            ("data", "fsdp", "tensor")))
    assert found["by_kind"]["all-gather"] == {"count": 5, "bytes": 5 * 32 * 4}
    assert found["by_kind"]["reduce-scatter"] == {"count": 1, "bytes": 32 * 4}
    assert found["cross_slice"] == {"all-reduce": {"count": 1, "bytes": 4 * 8 * 2}}
    assert found["by_axis"]["all-gather over fsdp"]["count"] == 5


# Over 64 chips the TPU compiler writes FSDP's weight gathers as all-reduces of each shard placed
# in a zero buffer, combined with the gradients' all-reduces (v5p:4x4x4, fsdp=64).
GATHER_AS_ALL_REDUCE = """HloModule m

%placed (p0: bf16[8,16], p1: bf16[2,16], p2: s32[]) -> bf16[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  ROOT %u2 = bf16[8,16]{1,0} dynamic-update-slice(%p0, %p1, %p2, %c0)
}

%product (q0: bf16[8,2], q1: bf16[2,16]) -> bf16[8,16] {
  ROOT %dot = bf16[8,16]{1,0} convolution(%q0, %q1), dim_labels=bf_io->bf
}

ENTRY %main (a: f32[2,8]) -> f32[8,8] {
  %z = bf16[8,8]{1,0} broadcast(%c), dimensions={}
  %u = bf16[8,8]{1,0} dynamic-update-slice(%z, %w, %i, %j)
  %f = bf16[8,16]{1,0} fusion(%x, %y), kind=kOutput, calls=%product
  %v = bf16[8,16]{1,0} fusion(%z2, %x, %k), kind=kLoop, calls=%placed
  %s = (bf16[8,16]{1,0}, u32[]) copy-start(%v)
  %d = bf16[8,16]{1,0} copy-done(%s)
  %g = f32[8,8]{1,0} add(%p, %q)
  %r = (bf16[8,8]{1,0}, bf16[8,16]{1,0}, f32[8,8]{1,0}) all-reduce(%u, %d, %g), replica_groups={{0,1,2,3}}, to_apply=%add
  %t = bf16[8,16]{1,0} all-reduce(%f), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %o = f32[8,8]{1,0} get-tuple-element(%r), index=2
}
"""  # noqa: E501 (HLO lines as the compiler writes them)


def test_all_gathers_written_as_all_reduces_are_counted_as_all_gathers():
    found = coll.summarize(coll.collectives(GATHER_AS_ALL_REDUCE, np.arange(4).reshape(1, 4, 1),
                                            ("data", "fsdp", "tensor")))
    # The tuple's two zero-buffer operands are gathers (one a fusion whose root places the
    # shard, through a copy); its gradient and the all-reduce of a product stay all-reduces.
    assert found["by_kind"]["all-gather"] == {"count": 1, "bytes": 8 * 8 * 2 + 8 * 16 * 2}
    assert found["by_kind"]["all-reduce"] == {"count": 2, "bytes": 8 * 8 * 4 + 8 * 16 * 2}


# ------------------------------------------------------------ the largest batch that fits


@pytest.mark.parametrize("most", [1, 5, 64])
def test_largest_fitting_finds_the_limit_a_brute_force_finds(most):
    from transformer_jax.parallel.pod import largest_fitting

    for limit in range(0, 70):
        asked = []

        def fits(n, limit=limit, asked=asked):
            asked.append(n)
            return n <= limit

        best, probes = largest_fitting(fits, most)
        assert best == max([n for n in range(1, most + 1) if n <= limit], default=0)
        assert [n for n, _ in probes] == asked and len(set(asked)) == len(asked)
        assert all(1 <= n <= most for n in asked) and len(asked) <= 2 * most.bit_length() + 1


def test_find_batch_sets_each_probes_batch_and_policy(monkeypatch, capsys):
    # compile_report stands in for the compiler here (the compiles themselves are tested
    # above): a step "fits" while its global batch is at most 40.
    asked = []

    def report(config, overrides, topology, slices):
        o = dict(x.split("=", 1) for x in overrides)
        asked.append((o["model.remat"], int(o["train.batch_size"])))
        batch = int(o["train.batch_size"])
        return {"fits": batch <= 40, "hbm_bytes": 16 * 2**30, "memory": {"peak": 1000 * batch}}

    monkeypatch.setattr(compile_cli, "compile_report", report)
    code = compile_cli.main(["--topology", "v5e:2x2", "--find-batch", "--remat", "full",
                             "--remat", "none", "--json", *TOY, "train.grad_accum=2"])
    found = json.loads(capsys.readouterr().out)
    # fsdp=4 splits the batch; 2 micro-batches a step: a probe of n a chip is 8 n sequences.
    assert code == 0 and found["batch_devices"] == 4
    for remat in ("full", "none"):
        row = found["policies"][remat]
        assert row["per_chip"] == 5 and row["batch_size"] == 40 and row["peak"] == 40_000
        assert [n for n, _ in row["probes"]] == [1, 2, 4, 8, 6, 5]
        assert [b for r, b in asked if r == remat] == [8, 16, 32, 64, 48, 40]


@pytest.mark.parametrize("argv", [["--remat", "full"], ["--find-batch", "--remat", "some"]])
def test_find_batch_options_are_checked(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        compile_cli.main(["--topology", "v5e:2x2", *argv])
    assert exit_info.value.code == 2 and "--remat" in capsys.readouterr().err


# ``--serve``: generate of the toy (4 kv heads of 128, 2 layers, float32) over tensor=4, with a
# KV cache too large for the chip's VMEM, so that the compiler keeps it in HBM, where its
# temporaries count it (a cache that fits VMEM, 128 MiB on v5e, is not in the HBM figures).
SERVE = ["--topology", "v5e:2x2", "--serve", "--tensor", "4", "--batch", "8",
         "--prompt-len", "8", "--new-tokens", "8", *TOY[:-2]]
SMALL_S, LARGE_S = 16384, 24576


def _serve_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = compile_cli.main([*SERVE, *argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def serve_small():
    code, out, _ = _serve_cli("--cache-size", str(SMALL_S), "--only", "generate", "--json")
    assert code == 0
    return json.loads(out)


@pytest.fixture(scope="module")
def serve_large():
    return compile_serve.serve_report("tiny", TOY[:-2], "v5e:2x2", tensor=4, batch=8,
                                      prompt_len=8, new_tokens=8, cache_size=LARGE_S, hlo=True)


def _toy_cache_bytes_per_chip(s: int, tensor: int = 4) -> int:
    # K and V, 2 layers, B=8, S slots, 4 kv heads of 128, float32; kv heads split.
    return 2 * 2 * 8 * s * 4 * 128 * 4 // tensor


def test_serve_generate_fits_and_all_reduces_over_tensor(serve_large):
    r = serve_large
    assert r["program"] == "generate" and r["mesh"]["tensor"] == 4 and r["devices"] == 4
    assert r["fits"] and 0 < r["memory"]["peak"] <= r["hbm_bytes"] == 16 * 2**30
    assert r["cache_bytes_per_chip"] == _toy_cache_bytes_per_chip(LARGE_S)
    assert _axes(r) == {"tensor"}
    # Per layer: the attention and MLP outputs, in the prefill and in the decode step.
    assert r["collectives"]["by_kind"]["all-reduce"]["count"] >= 2 * 2 * 2
    # No weight is gathered: the largest matrix shard of a chip is 128 x 512 / 4 floats (q, k,
    # v and o: d_model 128 to 4 heads of 128).
    weight_shard = 128 * 512 * 4 // 4
    assert all(math.prod(s) * 4 < weight_shard for s in _all_gathered_shapes(r["hlo"]))
    # Each chip holds its quarter of the weights (and the small inputs).
    assert r["weight_bytes"] / 4 <= r["memory"]["argument"] <= r["weight_bytes"] / 4 + 2**20


def test_serve_cache_size_raises_temporaries_by_the_cache_bytes(serve_small, serve_large):
    assert serve_small["memory"]["temp"] >= _toy_cache_bytes_per_chip(SMALL_S)
    grown = serve_large["memory"]["temp"] - serve_small["memory"]["temp"]
    implied = _toy_cache_bytes_per_chip(LARGE_S) - _toy_cache_bytes_per_chip(SMALL_S)
    assert 0.95 <= grown / implied <= 1.1
    assert serve_large["memory"]["argument"] == serve_small["memory"]["argument"]


def test_serve_report_prints(serve_large):
    text = compile_serve.format_serve_report(serve_large)
    assert "generate of tiny on v5e:2x2" in text and "all-reduce over tensor" in text
    assert f"S={LARGE_S}" in text and "fits" in text


def test_serve_overflow_is_one_line():
    code, _, err = _serve_cli("--cache-size", str(2**20))
    assert code == compile_cli.EXIT_DOES_NOT_FIT
    err = err.strip().splitlines()[-1]
    assert err.startswith("error: does not fit on v5e:2x2") and "RESOURCE_EXHAUSTED" in err


@pytest.mark.parametrize("argv", [["--tensor", "3"], ["--cache-size", "4"]])
def test_serve_bad_input_is_one_line(argv):
    code, _, err = _serve_cli(*argv)
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: ") and "Traceback" not in err
    if argv[0] == "--tensor":
        assert "n_kv_heads=4" in lines[-1]


def test_serve_options_need_serve(capsys):
    with pytest.raises(SystemExit) as e:
        compile_cli.main(["--topology", "v5e:2x2", "--tensor", "4"])
    assert e.value.code == 2 and "--tensor go with --serve" in capsys.readouterr().err


# The engine's step programs (``compile_engine``): decode rows for 8 slots and a prefill chunk of
# 32 tokens over a pool of POOL pages of 16, with the paged attention the engine picks for a TPU
# with ``attention_impl=pallas``: the Mosaic paged (decode) and ragged (prefill) kernels.
POOL = 300


@pytest.fixture(scope="module")
def engine():
    code, out, _ = _serve_cli("--only", "engine", "--chunk", "32", "--pages", str(POOL),
                              "--json", "model.attention_impl=pallas")
    assert code == 0 and "program" not in json.loads(out)  # generate not compiled
    return json.loads(out)["engine"]


def test_engine_steps_fit_all_reduce_over_tensor_and_hold_mosaic_kernels(engine):
    import jax

    assert jax.default_backend() == "cpu"  # the kernels follow the mesh's devices instead
    assert engine["kernels"] == {"decode": "tpu_paged", "prefill": "tpu_ragged"}
    assert engine["fits"] and engine["mesh"]["tensor"] == 4
    assert set(engine["programs"]) == {"decode", "prefill"}
    for p in engine["programs"].values():
        assert p["fits"] and 0 < p["memory"]["peak"] <= engine["hbm_bytes"] == 16 * 2**30
        assert _axes(p) == {"tensor"} and _kinds(p) == {"all-reduce"}  # nothing gathered
        assert p["collectives"]["by_kind"]["all-reduce"]["count"] >= 2 * 2  # attention, MLP
        assert p["mosaic_calls"] >= 1  # per device (an unsplit Mosaic call cannot compile)


def test_engine_pool_bytes_per_chip_follow_the_config(engine):
    # K and V, 2 layers, P pages of 16 positions, 4 kv heads of 128, float32, over 4 chips.
    assert engine["pages"] == POOL
    assert engine["pool_bytes_per_chip"] == 2 * 2 * POOL * 16 * 4 * 128 * 4 // 4
    for p in engine["programs"].values():  # donated: in the arguments, aliased by the output
        m = p["memory"]
        assert m["alias"] >= engine["pool_bytes_per_chip"] <= m["argument"]
        assert m["argument"] <= engine["pool_bytes_per_chip"] + engine["weight_bytes"] / 4 + 2**20


def test_engine_report_prints_and_overflows_in_one_line(engine):
    from transformer_jax.cli.compile_engine import format_engine_report

    text = format_engine_report(engine)
    assert "decode [8, 1]" in text and "prefill [1, 32]" in text and "tpu_ragged" in text
    code, _, err = _serve_cli("--only", "engine", "--pages", str(2**20))
    assert code == compile_cli.EXIT_DOES_NOT_FIT and len(err.strip().splitlines()) == 1
    assert "the engine's decode step: RESOURCE_EXHAUSTED" in err


@pytest.mark.parametrize("argv", [["--pages", "1"], ["--chunk", "0"], ["--page-size", "0"]])
def test_engine_bad_input_is_one_line(argv):
    code, _, err = _serve_cli("--only", "engine", *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
