"""LoRA adapters over HTTP on a real server process (the tiny Llama, CPU, float32), with the openai SDK:
an adapter named as the model gives HF + peft's greedy output, /v1/models lists adapters under their base,
adapters load and unload at run time while another request runs, and bad adapters are errors in OpenAI's
shape."""
import json
import shutil
import threading

import openai
import pytest

from support import XLA_CACHE_FLAGS
from support.lora import adapter_path, lora_golden
from support.server_process import ServerProcess
from support.servers import ServerSpec
from support.tiny_models import fixture_path


def _lora_server():
    return ServerProcess(
        fixture_path("tiny-llama3"), "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--kv-cache-memory",
        str(1 << 24), *XLA_CACHE_FLAGS, "--enable-lora",
        "--max-loras", "2", "--lora-modules", f"attn-r8={adapter_path('attn-r8')}",
        '{"name": "mlp", "path": "%s", "base_model_name": "tiny"}' % adapter_path("mlp-r16"),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})


SERVER = ServerSpec(_lora_server, must_survive=True)


def complete(client, model: str, prompt: list[int], max_tokens: int | None = None) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, temperature=0,
                                    max_tokens=max_tokens or lora_golden()["max_tokens"],
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    return out.choices[0].token_ids


def test_adapters_named_as_the_model_match_hf_peft(client):
    g = lora_golden()
    for model, name in (("tiny", None), ("attn-r8", "attn-r8"), ("mlp", "mlp-r16")):
        want = g["base"][0] if name is None else g["adapters"][name][0]
        assert complete(client, model, g["prompts"][0]) == want, model


def test_models_lists_adapters_under_their_base(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "attn-r8", "mlp"}
    assert cards["attn-r8"].parent == "tiny" and cards["attn-r8"].root == adapter_path("attn-r8")
    assert client.models.retrieve("mlp").parent == "tiny"


def test_unknown_adapter_is_a_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt=[5, 6], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_load_and_unload_while_another_request_runs(client, http):
    g = lora_golden()
    long_run = {}
    worker = threading.Thread(target=lambda: long_run.update(ids=complete(client, "attn-r8", g["prompts"][1], 200)))
    worker.start()
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "rs", "lora_path": adapter_path("all-r4-rslora")})
    assert r.status_code == 200, r.text
    assert complete(client, "rs", g["prompts"][2]) == g["adapters"]["all-r4-rslora"][2]
    # unloading an adapter in use: new requests get the 404 at once, the running one finishes with it
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "attn-r8"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="attn-r8", prompt=[5, 6], max_tokens=2)
    worker.join(timeout=300)
    assert long_run["ids"][:16] == g["adapters"]["attn-r8"][1]
    # loaded again under the same name: served again (a new adapter id: no prefix-cache blocks of the old one)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "attn-r8",
                                                    "lora_path": adapter_path("attn-r8")}).status_code == 200
    assert complete(client, "attn-r8", g["prompts"][1]) == g["adapters"]["attn-r8"][1]


@pytest.mark.parametrize("body, status, says", [
    ({"lora_name": "x", "lora_path": "/no/such/folder"}, 400, "does not exist"),
    ({"lora_name": "mlp", "lora_path": adapter_path("mlp-r16")}, 400, "already been loaded"),
    ({"lora_name": "tiny", "lora_path": adapter_path("mlp-r16")}, 400, "base model"),
    ({"lora_name": "x"}, 400, "lora_path"),
])
def test_bad_loads(http, body, status, says):
    r = http.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text


def test_unloading_an_unknown_adapter_is_a_404(http):
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404 and r.json()["error"]["type"]


def test_metrics_show_lora_requests_info(http):
    text = http.get("/metrics").text
    assert 'lora_requests_info{max_lora="2"' in text


def test_rank_above_max_lora_rank_is_refused(http, tmp_path):
    folder = tmp_path / "big"
    shutil.copytree(adapter_path("mlp-r16"), folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | {"r": 32}))
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(folder)})
    assert r.status_code == 400 and "above --max-lora-rank 16" in r.json()["error"]["message"]
