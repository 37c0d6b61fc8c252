"""The collectives of a compiled program, read from its optimized HLO text, per mesh axis.

``collectives(hlo_text, ids, axis_names)`` finds every collective of ``KINDS``, counts each as
often as one run executes it (``while`` bodies times their trip counts) and names the mesh axes
it runs over; the TPU compiler's rewrites (a reduce-scatter fusion, an all-gather written as an
all-reduce, a DCN ``send``) are read back as what they are.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from typing import Any

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.+?) ([a-z][\w-]*)\(")
_CALLEE = re.compile(r"\b(?:calls|body|to_apply|true_computation|false_computation)=%([\w.-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=(\{[{}\d, ]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|"
                     r"mesh\[[^\]]*\](?: \{[^}]*\})?)")
_PAIRS = re.compile(r"source_target_pairs=(\{[{}\d, ]*\})")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]+)"')


def array_bytes(type_text: str, largest: bool = False) -> int:
    """Bytes of the arrays in an HLO type (``bf16[8,128]{1,0}`` or a tuple of them)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(type_text):
        bits = 8 if dtype == "pred" else int(m.group(1)) if (m := re.match(r"[a-z]+(\d+)",
                                                                          dtype)) else 0
        sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])) * bits // 8)
    return (max(sizes) if largest else sum(sizes)) if sizes else 0


def parse_groups(text: str, n_ids: int) -> list[list[int]] | None:
    """Replica groups in any of HLO's forms -> lists of partition ids (None: unreadable):
    ``{{0,1},{2,3}}`` (``{}``: every id), iota ``[4,2]<=[2,4]T(1,0)``, and
    ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (a group per value of the axes not named)."""
    if text.startswith("{"):
        groups = [[int(x) for x in g.split(",") if x.strip()]
                  for g in re.findall(r"\{([\d, ]*)\}", text[1:-1])]
        groups = [g for g in groups if g]
        return groups or [list(range(n_ids))]
    if text.startswith("["):
        m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        out_shape, in_shape = ([int(x) for x in g.split(",")] for g in m.groups()[:2])
        ids = np.arange(int(np.prod(in_shape))).reshape(in_shape)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    m = re.match(r"mesh\[([^\]]*)\](?: \{([^}]*)\})?", text)
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    if not axes or ",".join(f"'{a}'={n}" for a, n in axes) != m.group(1).replace(" ", ""):
        return None  # sub-axes or a device order: not read here
    names = [a for a, _ in axes]
    ids = np.arange(int(np.prod([int(n) for _, n in axes]))).reshape([int(n) for _, n in axes])
    grouped = re.findall(r"'(\w+)'", m.group(2) or "")
    if not set(grouped) <= set(names):
        return None
    order = [names.index(a) for a in names if a not in grouped] + \
        [names.index(a) for a in grouped]
    size = int(np.prod([ids.shape[names.index(a)] for a in grouped])) if grouped else 1
    return ids.transpose(order).reshape(-1, size).tolist()


def mesh_axes_of(groups: list[list[int]], ids: np.ndarray, axis_names: tuple[str, ...]
                 ) -> str:
    """The mesh axes whose device groups are exactly ``groups`` (``"fsdp"``, ``"data+fsdp"``);
    ``"-"`` for groups of one device, ``"other"`` for groups no set of axes makes.

    Args:
      groups: lists of partition ids.
      ids: [axis sizes] array of the partition ids in mesh order (``pod.slice_mesh``).
      axis_names: the mesh's axis names.
    """
    if all(len(g) <= 1 for g in groups):
        return "-"
    want = {frozenset(g) for g in groups}
    live = [k for k, n in enumerate(ids.shape) if n > 1]
    for r in range(1, len(live) + 1):
        for subset in itertools.combinations(live, r):
            rest = [k for k in range(ids.ndim) if k not in subset]
            made = ids.transpose(rest + list(subset)).reshape(
                -1, int(np.prod([ids.shape[k] for k in subset])))
            if {frozenset(row.tolist()) for row in made} == want:
                return "+".join(axis_names[k] for k in subset)
    return "other"


def pair_axes(pairs_text: str, ids: np.ndarray, axis_names: tuple[str, ...]) -> str:
    """The mesh axes along which a collective-permute's source/target pairs move."""
    where = {int(v): np.unravel_index(i, ids.shape) for i, v in enumerate(ids.flat)}
    moved = set()
    for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs_text):
        if int(a) in where and int(b) in where:
            moved |= {k for k, (x, y) in enumerate(zip(where[int(a)], where[int(b)],
                                                       strict=True)) if x != y}
    return "+".join(axis_names[k] for k in sorted(moved)) or "-"


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if (m := _COMPUTATION.match(line)) and " = " not in line.split("{")[0]:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _trip_count(line: str, comps: dict[str, list[str]]) -> int:
    """Iterations of a ``while``: its known trip count, else JAX's ``i < N`` loop condition
    (a counter from 0, the one integer constant of the condition); 1 when neither is found."""
    if m := _TRIP.search(line):
        return int(m.group(1))
    cond = re.search(r"condition=%([\w.-]+)", line)
    body = comps.get(cond.group(1), []) if cond else []
    constants = [int(c) for b in body for c in re.findall(r"s32\[\]\S* constant\((\d+)\)", b)]
    if len(constants) == 1 and any("ROOT" in b and "direction=LT" in b for b in body):
        return constants[0]
    return 1


def _multiplicity(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times one run of the entry runs each computation."""
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _trip_count(line, comps) if " while(" in line else 1
            for callee in _CALLEE.findall(line):
                factor = trip if f"body=%{callee}" in line else 1
                callers[callee].append((name, factor))
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%([\w.-]+)", group):
                    callers[callee].append((name, 1))
    memo: dict[str, int] = {entry: 1}

    def count(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # a cycle (none in HLO) counts nothing
            memo[name] = sum(count(c) * f for c, f in callers.get(name, ()))
        return memo[name]

    return {name: count(name) for name in comps}


def collectives(hlo: str, ids: np.ndarray, axis_names: tuple[str, ...], dcn: str = "data"
                ) -> list[dict[str, Any]]:
    """Every collective of one run of a compiled program.

    Args:
      hlo: the compiled program's text (``compiled.as_text()``).
      ids: [axis sizes] partition ids of one slice in mesh order (``pod.slice_mesh``).
      axis_names: the mesh's axis names.
      dcn: the mesh axes that span slices (``pod.dcn_axes``), naming the DCN transfers.

    Returns:
      One dict per collective instruction: ``kind`` (one of ``KINDS``), ``axes`` (the mesh
      axes it runs over, ``"+"``-joined; ``"<dcn> (dcn)"`` between slices), ``bytes`` (its
      result on one device), ``count`` (times one run executes it) and ``cross_slice``.
    """
    comps, entry = _computations(hlo)
    times = _multiplicity(comps, entry)
    found = []
    for name, lines in comps.items():
        if not times.get(name):
            continue
        defs = {m.group(1): line for line in lines if (m := _INSTRUCTION.match(line))}
        for line in defs.values():
            m = _INSTRUCTION.match(line)
            type_text, op = m.group(2), m.group(3)
            if op == "send" and (t := _MEGASCALE.search(line)):
                rendezvous = _RENDEZVOUS.search(line)
                found.append({"kind": t.group(1).lower().replace("_", "-"),
                              "axes": f"{dcn} (dcn)",
                              "bytes": array_bytes(_ARRAY.search(type_text).group(0)),
                              "count": times[name], "cross_slice": True,
                              "name": rendezvous.group(1) if rendezvous else m.group(1)})
                continue
            base = op.removesuffix("-start")
            if base not in KINDS or op.endswith("-done"):
                continue
            kind = "reduce-scatter" if base == "all-reduce" and \
                name.startswith("all-reduce-scatter") else base
            if base == "collective-permute":
                axes = pair_axes(p.group(1), ids, axis_names) if (p := _PAIRS.search(line)) \
                    else "other"
            else:
                g = _GROUPS.search(line)
                groups = parse_groups(g.group(1), ids.size) if g else [list(range(ids.size))]
                axes = "other" if groups is None else mesh_axes_of(groups, ids, axis_names)
            nbytes = array_bytes(type_text, largest=op.endswith("-start") and base != "all-reduce")
            entry_ = {"kind": kind, "axes": axes, "bytes": nbytes, "count": times[name],
                      "cross_slice": False, "name": m.group(1)}
            gathered = _gathered_bytes(line, type_text, defs, comps) if kind == "all-reduce" else 0
            if gathered:
                found.append({**entry_, "kind": "all-gather", "bytes": gathered,
                              "as": "all-reduce"})
            if nbytes > gathered:
                found.append({**entry_, "bytes": nbytes - gathered})
    return found


def _gathered_bytes(line: str, type_text: str, defs: dict[str, str],
                    comps: dict[str, list[str]]) -> int:
    """Bytes of an all-reduce's operands that are all-gathers written as an all-reduce: a shard
    placed in a zero buffer by a ``dynamic-update-slice``, or a fusion whose root is one,
    through any copies."""
    operands = re.search(r" all-reduce(?:-start)?\(([^)]*)\)", line)
    names = re.findall(r"%([\w.-]+)", operands.group(1)) if operands else []
    arrays = _ARRAY.findall(type_text)
    if not names or len(names) != len(arrays):
        return 0
    total = 0
    for operand, (dtype, dims) in zip(names, arrays, strict=True):
        for _ in range(8):  # through copy-start / copy-done / copy
            d = _INSTRUCTION.match(defs.get(operand, ""))
            if d is None or d.group(3) not in ("copy", "copy-start", "copy-done"):
                break
            operand = re.search(rf" {d.group(3)}\(%([\w.-]+)", defs[operand]).group(1)
        if d is None:
            continue
        op = d.group(3)
        if op == "fusion" and (called := re.search(r"\bcalls=%([\w.-]+)", defs[operand])):
            root = next((r for r in comps.get(called.group(1), [])
                         if r.lstrip().startswith("ROOT ")), "")
            op = r.group(3) if (r := _INSTRUCTION.match(root)) else op
        if op == "dynamic-update-slice":
            total += array_bytes(f"{dtype}[{dims}]")
    return total


def summarize(found: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals of ``collectives``' list, per run (bytes summed over executions).

    Returns:
      ``{"by_kind": {kind: {"count", "bytes"}}, "by_axis": {"kind over axes": {...}},
      "cross_slice": {kind: {...}}}``.
    """
    out: dict[str, dict[str, dict[str, int]]] = {"by_kind": {}, "by_axis": {},
                                                 "cross_slice": {}}

    def add(table: dict[str, dict[str, int]], key: str, c: dict[str, Any]) -> None:
        row = table.setdefault(key, {"count": 0, "bytes": 0})
        row["count"] += c["count"]
        row["bytes"] += c["count"] * c["bytes"]

    for c in found:
        add(out["by_kind"], c["kind"], c)
        add(out["by_axis"], f"{c['kind']} over {c['axes']}", c)
        if c["cross_slice"]:
            add(out["cross_slice"], c["kind"], c)
    return out


def table_lines(summary: dict[str, Any]) -> list[str]:
    """``summarize``'s collectives by mesh axis as indented report lines: kind and axis, count,
    MiB per chip ("none" when the program holds none)."""
    rows = [f"    {key:<40} {row['count']:6d}  {row['bytes'] / 2**20:12.2f} MiB"
            for key, row in sorted(summary["by_axis"].items())]
    return rows or ["    none"]
