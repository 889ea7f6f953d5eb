"""Each decoder family's tiny HF checkpoint (tests/fixtures/models/tiny-*) through the engine, Pallas kernels
and the reference attention, against HF transformers' golden greedy ids; on a GPU this checks the kernels
with each family's attention features (soft-capping, sliding windows, q/k norms, partial rotary).

    python benchmarks/diagnostics/family_check.py                          # every family
    python benchmarks/diagnostics/family_check.py tiny-qwen3 tiny-gemma3   # these (q/k norms)
"""
import json
import os
import sys
import time

from jaxserve import LLM, SamplingParams
FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "models")
for name in sys.argv[1:] or ["tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3", "tiny-cohere", "tiny-llama3"]:
    path = os.path.join(FIX, name)
    gp = os.path.join(path, "golden.json")
    if not os.path.exists(gp):
        print(name, "no golden.json"); continue
    golden = json.load(open(gp))
    for backend in ("pallas", "reference"):
        t0 = time.time()
        try:
            llm = LLM(path, dtype="float32", max_model_len=128, block_size=16, max_num_batched_tokens=64,
                      max_num_seqs=4, enable_prefix_caching=True, attention_backend=backend,
                      compilation_cache_dir="", use_tqdm_on_load=False, gpu_memory_utilization=0.05)
            ids = [golden["prompt_ids"]] * 3
            outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=len(golden["greedy_ids"]), ignore_eos=True), use_tqdm=False)
            got = outs[0].outputs[0].token_ids
            diff = next((i for i, (a, b) in enumerate(zip(got, golden["greedy_ids"])) if a != b), None)
            print(f"{name} {backend}: {'MATCH' if diff is None else f'first diff at {diff}'} "
                  f"copies equal: {all(o.outputs[0].token_ids == got for o in outs)} ({time.time() - t0:.0f} s)", flush=True)
            del llm
        except Exception as e:
            print(f"{name} {backend}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
