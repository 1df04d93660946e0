"""Write a random-weight Llama checkpoint of real shapes, sharded, in bf16 (for timing and memory runs on the GPU).

    python dev/make_random_checkpoint.py llama2-7b OUT --tokenizer TOKDIR [--layers 8] [--device cuda]

There is no model hub on the lent GPU: the checkpoints that issue 25's
numbers need are made there.  The tokenizer is copied from TOKDIR (SmolLM2's,
vocabulary 49152); llama2-7b keeps its 4096 x 11008 x 32-layer shapes but
gets a vocabulary of 49152 so that every token id fits (embeddings are not
quantized, so only their size changes).  Random weights make time and memory
real, not perplexity.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=49152, max_position_embeddings=4096),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True, help="directory with tokenizer.json / tokenizer_config.json")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shard", default="5GB", help="max_shard_size for save_pretrained")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import transformers

    kw = dict(SHAPES[args.shape])
    if args.layers:
        kw["num_hidden_layers"] = args.layers
    cfg = transformers.LlamaConfig(**kw, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    t0 = time.time()
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = Path(args.out)
    model.save_pretrained(out, max_shard_size=args.shard)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(args.tokenizer) / f).exists():
            shutil.copy(Path(args.tokenizer) / f, out / f)
    n = sum(p.numel() for p in model.parameters())
    files = sorted(out.glob("*.safetensors"))
    print(f"{out}: {args.shape} with {cfg.num_hidden_layers} layers, {n / 1e9:.2f} B parameters, "
          f"{len(files)} shards, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB, {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
