"""Greedy tokens from vLLM for the plugin's tests (tests/test_vllm.py runs this in the vLLM venv).

    python tests/vllm_generate.py '{"model": DIR, "tp": 1, "prompts": [[ids...]], "max_tokens": 8}'

Prints one line ``QGEMV_TOKENS <json list of token-id lists>``; vLLM's own
errors go to stderr with a non-zero exit.  vLLM starts its workers with
spawn, hence the __main__ guard.
"""

import json
import sys


def main() -> int:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], tensor_parallel_size=spec.get("tp", 1), dtype=spec.get("dtype", "float32"),
              max_model_len=spec.get("max_model_len", 256), enforce_eager=spec.get("eager", True), seed=0,
              **spec.get("kwargs", {}))
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    print("QGEMV_TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
