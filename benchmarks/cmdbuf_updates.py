"""Which commands of a step's command buffer XLA updates on a call, from XLA's dumps of the compiled step.

NOTE (XLA's rule, openxla/xla ``CommandBufferThunk::ExecuteOnStream`` and ``CommandExecutor::RecordUpdate``):
on each call the thunk compares the address of every buffer allocation its commands use with the address it
recorded last (allocations marked persistent are not compared: constants and, under ``SKIP_TEMP``, the
preallocated temp, which XLA maps at one virtual address); when any moved, it updates exactly the commands
that use a moved allocation (a kernel: ``cuGraphExecKernelNodeSetParams``; a copy: its memcpy node) and skips
the rest. So a call's host cost of updating grows with the commands that touch an allocation whose address
changes from call to call, not with all of them.

Which allocations change from call to call in a step: the per-step inputs (the packed int32 inputs, the
previous step's tokens: fresh host-to-device or sampler buffers each step) and the outputs not aliased to a
donated input (the logits, an MoE step's expert load): PJRT allocates those anew on every call, so they count
here as moving (whether the allocator happens to hand back the same address is for a GPU run to say). The
weights and the donated KV cache keep their addresses. XLA's buffer assignment may also place temporaries of the whole
step in an output's allocation (its live range leaves room), and then every command using such a temporary is
updated on every call as well.
"""
from __future__ import annotations

import collections
import re

ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
VALUE_IN_ALLOCATION = re.compile(r"^ value: <(\d+) ")
VALUE = re.compile(r"^<(\d+) (\S+) @\d+>$")
USE = re.compile(r"^  (\S+), operand \d+")
PARAMETER = re.compile(r"parameter (\d+), shape \|([^|]*)\|")
FROM_PARAMETER = re.compile(r"^ from instruction: %(\S+) = \S+ parameter\((\d+)\)")
METADATA = re.compile(r'profile_annotation: "([^"]*)"\s*(?:thunk_id: (\d+)\s*)?}\s*thunk_kind: "(\w+)"')
THUNK = re.compile(r"^( *)(\d+): (\w+)")

# entry parameters whose buffers the engine keeps from call to call: the weights and the donated KV cache
STABLE_PARAMETERS = ("params", "kv_caches")


def thunks(sequence: str):
    """``(top-level kind, depth, thunk id, kind)`` of each thunk in XLA's thunk-sequence dump, in order; a
    top-level thunk's first item is its own kind."""
    top_kind = None
    for line in sequence.splitlines():
        m = THUNK.match(line)
        if m:
            indent, thunk_id, kind = len(m.group(1)), int(m.group(2)), m.group(3)
            top_kind = kind if indent == 0 else top_kind
            yield top_kind, indent, thunk_id, kind


def allocations(buffer_assignment: str) -> tuple[dict[int, dict], dict[int, int]]:
    """({allocation index: {size, parameter, shape, live_out, temp, constant, thread_local, output}},
    {value id: allocation index}) from XLA's ``*-buffer-assignment.txt`` dump."""
    allocs, value_alloc, current = {}, {}, None
    for line in buffer_assignment.splitlines():
        m = ALLOCATION.match(line)
        if m:
            current, rest = int(m.group(1)), m.group(3)
            p = PARAMETER.search(rest)
            allocs[current] = {"size": int(m.group(2)), "parameter": int(p.group(1)) if p else None,
                               "shape": p.group(2) if p else None, "live_out": "maybe-live-out" in rest,
                               "temp": "preallocated-temp" in rest, "constant": "constant" in rest,
                               "thread_local": "thread-local" in rest, "output": "output shape is" in rest}
            continue
        m = VALUE_IN_ALLOCATION.match(line)
        if m and current is not None:
            value_alloc[int(m.group(1))] = current
    return allocs, value_alloc


def instruction_allocations(values: str, value_alloc: dict[int, int]) -> tuple[dict, dict[int, str]]:
    """({HLO instruction: allocations it writes or reads}, {parameter number: its HLO name}) from XLA's
    ``*-buffer-assignment-values.txt`` dump: a value is written by the instruction that defines it and read by
    each instruction in its uses (bitcasts and tuple elements define no value, so their users are listed)."""
    touched: dict[str, set[int]] = collections.defaultdict(set)
    names: dict[int, str] = {}
    value, in_uses = None, False
    for line in values.splitlines():
        m = VALUE.match(line)
        if m:
            value, in_uses = int(m.group(1)), False
            if value in value_alloc:
                touched[m.group(2).split("{")[0]].add(value_alloc[value])
            continue
        if line.startswith(" uses:"):
            in_uses = True
        elif line.startswith(" from instruction:"):
            in_uses = False
            p = FROM_PARAMETER.match(line)
            if p:
                names[int(p.group(2))] = p.group(1)
        elif in_uses and value in value_alloc:
            u = USE.match(line)
            if u:
                touched[u.group(1)].add(value_alloc[value])
    return touched, names


def per_call(alloc: dict, names: dict[int, str], skip_temp: bool = True) -> str | None:
    """What makes ``alloc``'s address change from call to call (a label), or None when it keeps it."""
    if alloc["constant"] or alloc["thread_local"]:
        return None
    if alloc["temp"]:
        return None if skip_temp else "temp"
    if alloc["parameter"] is not None:
        name = names.get(alloc["parameter"], f"parameter {alloc['parameter']}")
        return None if name.startswith(STABLE_PARAMETERS) else f"input {name.split('.')[0]} {alloc['shape']}"
    if alloc["live_out"] or alloc["output"]:
        return "output tuple" if alloc["output"] else "output"
    return None


def moving_commands(sequence: str, metadata: str, buffer_assignment: str, values: str,
                    skip_temp: bool = True) -> dict:
    """The commands inside command buffers that use an allocation whose address changes from call to call
    (the ones XLA updates on every call), by what moves, from XLA's thunk and buffer-assignment dumps."""
    allocs, value_alloc = allocations(buffer_assignment)
    touched, names = instruction_allocations(values, value_alloc)
    moving = {i: label for i, a in allocs.items() if (label := per_call(a, names, skip_temp))}
    output_values = collections.Counter(value_alloc[v] for v in value_alloc if value_alloc[v] in moving)
    annotation = {int(i or 0): name for name, i, _ in METADATA.findall(metadata)}
    commands, hit, unmapped = 0, collections.Counter(), 0
    by_reason: collections.Counter = collections.Counter()
    for top_kind, indent, thunk_id, kind in thunks(sequence):
        if indent == 0 or top_kind != "kCommandBuffer":
            continue
        commands += 1
        name = annotation.get(thunk_id)
        if name not in touched:
            unmapped += 1
            continue
        reasons = {moving[a] + (f" (alloc {a}, {output_values[a]} values)" if moving[a] == "output" else "")
                   for a in touched[name] if a in moving}
        if reasons:
            hit[kind] += 1
            by_reason.update(reasons)
    return {"moving_commands": sum(hit.values()), "moving_by_kind": dict(hit),
            "moving_by_allocation": dict(by_reason.most_common()), "moving_of": commands,
            "moving_unmapped": unmapped}
