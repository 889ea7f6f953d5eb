"""Benchmark configs: YAML files under configs/bench/, `--set key=value` overrides (dotted keys), defaults."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml

from jaxserve import envs

REPO_ROOT = Path(__file__).resolve().parent.parent      # the source checkout, when benchmarks/ runs from one
# configs/ (bench/, models/, hardware/): $JAXSERVE_CONFIGS for an installed jaxserve, else the checkout's
CONFIGS_DIR = Path(envs.JAXSERVE_CONFIGS) if envs.JAXSERVE_CONFIGS else REPO_ROOT / "configs"
BENCH_CONFIG_DIR = CONFIGS_DIR / "bench"


def missing_configs() -> str | None:
    """Why the benchmark configs cannot be found (None when they can): an installed jaxserve carries no configs/."""
    if BENCH_CONFIG_DIR.is_dir():
        return None
    where = f"JAXSERVE_CONFIGS={CONFIGS_DIR}" if envs.JAXSERVE_CONFIGS else f"{CONFIGS_DIR} (not a source checkout)"
    return (f"jaxserve bench reads the configs/ folder of a jaxserve source checkout (bench/, models/, hardware/), "
            f"and {where} has no bench/: set JAXSERVE_CONFIGS=/path/to/jaxserve/configs")


MODES = ("throughput", "latency", "serve", "startup", "kernels", "lora")

# Every key a config may have, with its default. `engine` is passed through to LLM(...) / serve flags.
DEFAULTS: dict[str, Any] = {
    "name": None, "description": "", "mode": None, "seed": 0,
    "hardware": "auto",             # auto | a configs/hardware name | a YAML path
    "model": {"name": None, "path": None, "load_format": "auto"}, "engine": {}, "workload": {},
    "baseline": {"hf": False, "methods": None, "num_prompts": None, "iters": None, "python": None,
                 "device": "auto", "timeout_s": 900},
    "serve": {"base_url": None, "api_key": None, "server_args": [], "startup_timeout_s": 900,
              "request_timeout_s": 600},
    "kernels": {"args": []}, "report": {"plots": True},
}

WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "throughput": {"num_prompts": 100, "input_len": 128, "output_len": 128, "ignore_eos": True,
                   "temperature": 0.0, "warmup_prompts": 2},
    "latency": {"batch_size": 1, "input_len": 128, "output_len": 128, "ignore_eos": True,
                "temperature": 0.0, "warmup_iters": 1, "iters": 5, "prefill_iters": 3},
    "serve": {"dataset": "random", "num_prompts": 100, "input_len": 128, "output_len": 128,
              "dataset_path": None, "num_prefixes": 4, "prefix_len": 256, "ignore_eos": True,
              "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None, "warmup_requests": 2,
              "sweep": None, "slo": {}, "structured_fraction": 0.0, "structured_schema": None,
              "image_size": 448},      # dataset images: one random image_size² image per chat request
    "startup": {"prompt": "What is the capital of France?", "max_tokens": 16},
    "kernels": {},
    "lora": {"batch_sizes": [1, 64], "adapters": [0, 1, 4, 16], "rank": 16, "input_len": 128, "output_len": 128,
             "ignore_eos": True, "temperature": 0.0, "warmup_iters": 1, "iters": 3, "prefill_iters": 2,
             "load_iters": 3},
}


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


class ConfigError(ValueError):
    """A config the user can fix: the message says which key and why."""


def parse_set(item: str) -> tuple[list[str], Any]:
    """'a.b=3' → (['a', 'b'], 3); the value is read as YAML (numbers, true/false, null, [lists])."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value (e.g. --set workload.num_prompts=10)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        value = float(value)               # YAML 1.1 reads 1.5e3 as a string
    return key.strip().split("."), value


def set_dotted(cfg: dict, path: list[str], value: Any) -> None:
    node = cfg
    for part in path[:-1]:
        if node.get(part) is None:
            node[part] = {}
        if not isinstance(node[part], dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is a {type(node[part]).__name__}, not a section")
        node = node[part]
    node[path[-1]] = value


def merge_defaults(cfg: dict, defaults: dict) -> dict:
    out = copy.deepcopy(defaults)
    for k, v in cfg.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_defaults(v, out[k])
        else:
            out[k] = copy.deepcopy(v)
    return out


def resolve_config_path(name_or_path: str) -> Path:
    """A path, or a name under configs/bench/ (with or without .yaml)."""
    p = Path(name_or_path)
    for cand in (p, BENCH_CONFIG_DIR / p, BENCH_CONFIG_DIR / f"{name_or_path}.yaml"):
        if cand.is_file():
            return cand
    known = ", ".join(sorted(x.stem for x in BENCH_CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"benchmark config {name_or_path!r} not found (known in configs/bench: {known})")


def load_config(name_or_path: str | None, overrides: list[str] = (), base: dict | None = None) -> dict:
    """The full config: the YAML file (or `base`), `--set` overrides applied, defaults filled, validated."""
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        raw.setdefault("name", path.stem)
    else:
        raw = copy.deepcopy(base or {})
    for item in overrides:
        keys, value = parse_set(item)
        set_dotted(raw, keys, value)
    return validate(raw)


def load_configs(names: list[str], overrides: list[str]) -> list[dict]:
    """Several configs with the same --set overrides. A `workload.KEY` override that some given config's
    mode uses is skipped for the configs whose mode does not (e.g. num_prompts for a latency config run
    together with a throughput one); a key no given config uses is still an error."""
    if len(names) == 1:
        return [load_config(names[0], overrides)]
    set_mode = [value for keys, value in map(parse_set, overrides) if keys == ["mode"]]
    modes = [set_mode[-1] if set_mode else (yaml.safe_load(resolve_config_path(n).read_text()) or {}).get("mode")
             for n in names]
    used = {k for m in modes if m in WORKLOAD_DEFAULTS for k in WORKLOAD_DEFAULTS[m]}
    return [load_config(n, [item for item, (keys, _) in ((i, parse_set(i)) for i in overrides)
                            if not (keys[0] == "workload" and len(keys) > 1 and keys[1] in used
                                    and keys[1] not in WORKLOAD_DEFAULTS.get(mode, {}))])
            for n, mode in zip(names, modes)]


def validate(raw: dict) -> dict:
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)} (known: {', '.join(DEFAULTS)})")
    cfg = merge_defaults(raw, DEFAULTS)
    mode = cfg["mode"]
    if mode not in MODES:
        raise ConfigError(f"mode is {mode!r}; expected one of {', '.join(MODES)}")
    if not cfg["name"]:
        cfg["name"] = mode
    wl_defaults = WORKLOAD_DEFAULTS[mode]
    if mode != "kernels":
        bad = sorted(set(cfg["workload"]) - set(wl_defaults))
        if bad:
            raise ConfigError(f"workload key(s) {', '.join(bad)} are not used by mode {mode!r} "
                              f"(known: {', '.join(wl_defaults)})")
    cfg["workload"] = merge_defaults(cfg["workload"], wl_defaults)
    m = cfg["model"]
    if m.get("name") and m.get("path"):
        raise ConfigError("model: give either name (a configs/models entry) or path, not both")
    if m.get("load_format") == "dummy" and not (m.get("name") or m.get("path")):
        raise ConfigError("model.load_format is dummy but no model.name says which shape to build")
    if not isinstance(cfg["engine"], dict):
        raise ConfigError("engine: expected a mapping of LLM(...) options")
    return cfg


def engine_kwargs(cfg: dict) -> dict[str, Any]:
    """Keyword arguments for jaxserve.LLM(...): model, load_format and the engine section, whose keys must be
    engine options (jaxserve/config.py declares them: they are the serve flags too)."""
    from jaxserve.config import EngineConfig
    from jaxserve.options import options_of, unknown_option
    known = {o.name for o in options_of(EngineConfig)}
    for key in cfg["engine"]:
        if key not in known:
            raise ConfigError(f"engine: {unknown_option(key, known)}")
    m = cfg["model"]
    kw: dict[str, Any] = {"model": m.get("path") or m.get("name")}
    if m.get("load_format") not in (None, "auto"):
        kw["load_format"] = m["load_format"]
    kw.update({k: v for k, v in cfg["engine"].items() if v is not None})
    kw.setdefault("seed", cfg["seed"])
    return kw


# LLM(...) keyword → serve flag where the names differ
FLAG_NAMES = {"kv_cache_memory_bytes": "--kv-cache-memory"}


def server_flags(cfg: dict) -> list[str]:
    """`python -m jaxserve serve` arguments for the same model and engine options (vLLM flag names)."""
    kw = engine_kwargs(cfg)
    model = kw.pop("model")
    args = [str(model)] if model else []
    for key, value in kw.items():
        flag = FLAG_NAMES.get(key, "--" + key.replace("_", "-"))
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            args += [flag, *map(str, value)]
        else:   # a dict (speculative_config, limit_mm_per_prompt) as the JSON its flag takes
            args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return args + [str(a) for a in cfg["serve"]["server_args"]]
