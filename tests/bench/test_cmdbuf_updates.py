"""benchmarks/cmdbuf_updates.py: which commands of a step's command buffer use an allocation whose address
changes from call to call (the ones XLA updates on every call), from XLA's dumps."""
from jaxserve.benchmarks import cmdbuf_updates

# XLA's dumps, cut down: weights, the donated KV cache, the packed inputs, the logits output (which XLA also
# lent to a layer's temporary), the preallocated temp; five commands in one command buffer, one outside
BUFFER_ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, page 0, parameter 0, shape |bf16[4,8]| at ShapeIndex {}:
 value: <0 params__w__.1 @0> (size=64,offset=0): bf16[4,8]{1,0}
allocation 1: size 64, page 0, parameter 1, shape |bf16[4,8]| at ShapeIndex {}, maybe-live-out:
 value: <1 kv_caches_0__0_.1 @0> (size=64,offset=0): bf16[4,8]{1,0}
 value: <6 kv_write @0> (size=64,offset=0): bf16[4,8]{1,0}
allocation 2: size 16, page 0, parameter 2, shape |s32[4]| at ShapeIndex {}:
 value: <2 ints.1 @0> (size=16,offset=0): s32[4]{0}
allocation 3: size 32, page 0, maybe-live-out:
 value: <3 layer_fusion @0> (size=32,offset=0): f32[8]{0}
 value: <5 head_fusion @0> (size=32,offset=0): f32[8]{0}
allocation 4: size 4, page 0, thread-local:
 value: <7 add.1 @0> (size=4,offset=0): f32[]
allocation 5: size 128, page 0, preallocated-temp:
 value: <4 copy_slice @0> (size=16,offset=0): s32[4]{0}
 value: <8 norm_fusion @0> (size=32,offset=32): f32[8]{0}
"""
VALUES = """BufferAssignment:
Used values:
<0 params__w__.1 @0>
 positions:
  params__w__.1
 uses:
  layer_fusion, operand 0
  norm_fusion, operand 0
 from instruction: %params__w__.1 = bf16[4,8]{1,0} parameter(0)
<1 kv_caches_0__0_.1 @0>
 positions:
  kv_caches_0__0_.1
 uses:
  kv_write, operand 0
 from instruction: %kv_caches_0__0_.1 = bf16[4,8]{1,0} parameter(1)
<2 ints.1 @0>
 positions:
  ints.1
  bitcast.1
 uses:
  copy_slice, operand 0
  kv_write, operand 1
 from instruction: %ints.1 = s32[4]{0} parameter(2)
<3 layer_fusion @0>
 positions:
  layer_fusion
 uses:
  norm_fusion, operand 1
 from instruction: %layer_fusion = f32[8]{0} fusion(%params__w__.1)
<4 copy_slice @0>
 positions:
  copy_slice
 uses:
  (none)
 from instruction: %copy_slice = s32[4]{0} fusion(%ints.1)
<5 head_fusion @0>
 positions:
  head_fusion
 uses:
  (none)
 from instruction: %head_fusion = f32[8]{0} fusion(%norm_fusion)
<8 norm_fusion @0>
 positions:
  norm_fusion
 uses:
  head_fusion, operand 0
 from instruction: %norm_fusion = f32[8]{0} fusion(%params__w__.1, %layer_fusion)
"""
SEQUENCE = """000: kCommandBuffer [source | sink]
    001: kCopy         [source       | next=002 (1)] kCopy
    002: kCustomKernel [prev=001 (1) | next=003 (1)] kv_write
    003: kCustomKernel [prev=002 (1) | next=004 (1)] layer_fusion
    004: kCustomKernel [prev=003 (1) | next=005 (1)] norm_fusion
    005: kCustomKernel [prev=004 (1) | sink        ] head_fusion
006: kCustomKernel [source | sink] outside_fusion
"""
METADATA = "\n".join(f"""thunk_metadata {{
  thunk_info {{
    profile_annotation: "{name}"
    thunk_id: {i}
  }}
  thunk_kind: "{kind}"
}}""" for i, name, kind in [(1, "copy_slice", "kCopy"), (2, "kv_write", "kCustomKernel"),
                            (3, "layer_fusion", "kCustomKernel"), (4, "norm_fusion", "kCustomKernel"),
                            (5, "head_fusion", "kCustomKernel"), (6, "outside_fusion", "kCustomKernel")])


def test_allocations_say_what_each_holds():
    allocs, value_alloc = cmdbuf_updates.allocations(BUFFER_ASSIGNMENT)
    assert allocs[1]["parameter"] == 1 and allocs[1]["live_out"]
    assert allocs[3]["live_out"] and allocs[3]["parameter"] is None
    assert allocs[5]["temp"] and allocs[4]["thread_local"]
    assert value_alloc[5] == 3 and value_alloc[4] == 5


def test_per_call_allocations_are_fresh_inputs_and_outputs_not_weights_cache_or_temp():
    allocs, value_alloc = cmdbuf_updates.allocations(BUFFER_ASSIGNMENT)
    _, names = cmdbuf_updates.instruction_allocations(VALUES, value_alloc)
    labels = {i: cmdbuf_updates.per_call(a, names) for i, a in allocs.items()}
    assert labels == {0: None, 1: None, 2: "input ints s32[4]", 3: "output", 4: None, 5: None}
    assert cmdbuf_updates.per_call(allocs[5], names, skip_temp=False) == "temp"


def test_moving_commands_are_those_using_an_input_or_an_output_allocation():
    row = cmdbuf_updates.moving_commands(SEQUENCE, METADATA, BUFFER_ASSIGNMENT, VALUES)
    # the copy and the KV write read the inputs; the layer's temporary and the head use the logits' allocation,
    # and the norm reads that temporary; the command outside the buffer is not counted
    assert row["moving_of"] == 5 and row["moving_unmapped"] == 0
    assert row["moving_commands"] == 5
    assert row["moving_by_allocation"] == {"output (alloc 3, 2 values)": 3, "input ints s32[4]": 2}
    no_outputs = BUFFER_ASSIGNMENT.replace("allocation 3: size 32, page 0, maybe-live-out:",
                                           "allocation 3: size 32, page 0, preallocated-temp:")
    row = cmdbuf_updates.moving_commands(SEQUENCE, METADATA, no_outputs, VALUES)
    assert row["moving_commands"] == 2 and row["moving_by_kind"] == {"kCopy": 1, "kCustomKernel": 1}
