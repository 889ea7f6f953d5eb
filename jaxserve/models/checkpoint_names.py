"""HF checkpoint tensor names of the decoder weights, and how each weight is built from them.

A family's ``weight_plan(cfg)`` is a list of ``(param path, HF tensor names, build)``, one per leaf of its
weight pytree, from its names per layer weight (``llama.LAYER_NAMES`` is the layout most families extend);
the loaders (safetensors, GGUF) only supply ``get(hf_name)`` in HF layout. Builds (run on the device by
``hf_weights.load_weights``): ``"same"`` (as is), ``"t"`` (an HF Linear ``[out, in]`` → ``[in, out]``),
``"stack_t"`` (gate and up, each transposed, stacked on axis 1: ``[in, 2, out]``), ``"cat_t"`` (projections of
one input, each transposed, side by side on the output axis: DeepSeek's ``q_a_proj`` and ``kv_a_proj_with_mqa`` as
``[in, q_out + kv_out]``), ``("rows_t", start, stop)``
(rows ``start:stop`` of a fused projection, transposed: Phi-3's ``qkv_proj``), ``"fused_gate_up_t"`` (a
fused ``[2 * out, in]`` gate-then-up projection → ``[in, 2, out]``: Phi-3's ``gate_up_proj``) and ``("mla_uk", heads,
nope)`` / ``("mla_uv", heads, nope)`` (DeepSeek's ``kv_b_proj`` ``[heads * (nope + v), R]`` split by head into its key
rows ``[heads, nope, R]`` and its value rows transposed, ``[heads, R, v]``).
"""
from __future__ import annotations

from typing import Callable

# the weights outside the layers
TOP = {"embed": ("same", ["model.embed_tokens.weight"]), "final_norm": ("same", ["model.norm.weight"]),
       "lm_head": ("t", ["lm_head.weight"])}


def weight_plan(shapes: dict, layer_names: Callable[[int], dict] | dict, top: dict = TOP,
                prefix: str = "model.layers.") -> list[tuple[tuple, list[str], object]]:
    """The plan for every leaf of ``shapes`` (a family's ``param_shapes``), in the order of ``top`` and
    ``layer_names``; ``layer_names`` maps a layer weight to ``(build, names relative to "<prefix><i>.")``
    (a dict, or a function of the layer index)."""
    plan = [((name,), list(build_names[1]), build_names[0]) for name, build_names in top.items() if name in shapes]
    for i, layer in enumerate(shapes["layers"]):
        names = layer_names(i) if callable(layer_names) else layer_names
        if "qkv" in layer and "qkv" not in names:
            names = fused_qkv_names(names)
        missing = set(layer) - set(names)
        assert not missing, f"no checkpoint names for {sorted(missing)}"
        pre = f"{prefix}{i}."
        plan += [(("layers", i, weight), [pre + n for n in hf], build)
                 for weight, (build, hf) in names.items() if weight in layer]
    return plan


def fused_qkv_names(names: dict) -> dict:
    """A layer's names with q, k and v (each a plain ``"t"`` build) as one ``qkv`` weight: their tensors side by
    side on the output axis (``"cat_t"``, q then k then v); unchanged when they are built otherwise."""
    parts = [names.get(w) for w in ("q", "k", "v")]
    if any(p is None or p[0] != "t" for p in parts):
        return names
    return {**{w: b for w, b in names.items() if w not in ("q", "k", "v")},
            "qkv": ("cat_t", [n for p in parts for n in p[1]])}


# Where a multimodal wrapper (Gemma 3's ConditionalGeneration) keeps its text model's tensors: transformers 5
# saves "model.language_model.<...>", the hub's original checkpoints have "language_model.model.<...>".
_WRAPPED = ((r"model.", ("model.language_model.", "language_model.model.")),
            (r"lm_head.", ("language_model.lm_head.",)),
            # a LLaVA-style wrapper's vision tower and projector: top level or under "model." (transformers 5);
            # the hub's original checkpoints keep a CLIP / SigLIP tower's tensors under its "vision_model."
            (r"vision_tower.", ("model.vision_tower.", "vision_tower.vision_model.",
                                "model.vision_tower.vision_model.")),
            (r"multi_modal_projector.", ("model.multi_modal_projector.",)),
            (r"image_newline", ("model.image_newline",)),     # LLaVA-NeXT's
            (r"visual.", ("model.visual.",)),          # Qwen2.5-VL's vision tower
            (r"vision_model.", ("model.vision_model.",)))   # Llama 3.2 Vision's


def wrapped_names(hf_name: str) -> tuple[str, ...]:
    """The other spellings of a text-model tensor name inside a multimodal checkpoint."""
    for prefix, wrapped in _WRAPPED:
        if hf_name.startswith(prefix):
            return tuple(w + hf_name[len(prefix):] for w in wrapped)
    return ()


def moe_layer_names(num_experts: int, block: str, router: str, gate: str, up: str, down: str) -> dict:
    """The MoE weights of a layer (``layers.moe``) from HF's per-expert tensors under ``<block>.``, stacked at
    load: ``"experts_stack_t"`` (each expert's gate and up transposed and stacked: ``[E, in, 2, out]``, names
    ordered gate 0, up 0, gate 1, ...) and ``"experts_t"`` (each expert's Linear transposed: ``[E, in, out]``)."""
    experts = range(num_experts)
    return {
        "router": ("t", [f"{block}.{router}.weight"]),
        "experts_gate_up": ("experts_stack_t", [f"{block}.experts.{e}.{p}.weight" for e in experts for p in (gate, up)]),
        "experts_down": ("experts_t", [f"{block}.experts.{e}.{down}.weight" for e in experts]),
    }


def hf_shapes(plan: list, shapes: dict) -> dict[str, tuple[int, ...]]:
    """Each HF tensor of a ``weight_plan`` with its shape, from the weights' ``shapes`` (the family's
    ``param_shapes``): what a checkpoint of that shape holds. The builds with a layout of their own (a fused
    projection's rows, MLA's split) are not inverted."""
    hf = {}
    for path, names, build in plan:
        s = shapes
        for p in path:
            s = s[p]
        layouts = {"same": lambda: [s], "t": lambda: [s[::-1]], "stack_t": lambda: [(s[2], s[0])] * 2,
                   "experts_stack_t": lambda: [(s[3], s[1])] * len(names),
                   "experts_t": lambda: [(s[2], s[1])] * len(names)}
        if not isinstance(build, str) or build not in layouts:
            raise ValueError(f"no HF layout for {'.'.join(map(str, path))}'s build {build!r}")
        hf.update(zip(names, map(tuple, layouts[build]())))
    return hf
