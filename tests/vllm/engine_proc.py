"""An engine of the resume tests run as its own process (its process group is SIGKILLed).

argv[1]: JSON {"model", "secret_file", "port", "requests": {request_id: {"prompt": [token ids],
"max_tokens": n, "lumen": {...kv_transfer_params["lumen"] beyond request_id}}}}. Serves every
request through LumenConnector and prints, after every engine step, one line PREFIX + JSON
{request_id: {"tokens": [output token ids so far], "num_cached_tokens": n, "finish_reason"}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engines import engine_kwargs, greedy, params, transfer_config
from vllm import LLM

# vLLM logs to stdout too: the parent reads only lines that start with this.
PREFIX = "emitted "


def main() -> None:
    job = json.loads(sys.argv[1])
    config = transfer_config(Path(job["secret_file"]), Path(job["issuer_key_file"]), job["port"])
    engine = LLM(**engine_kwargs(Path(job["model"]), kv_transfer_config=config)).llm_engine
    for request_id, request in job["requests"].items():
        sampling = greedy(request["max_tokens"], extra_args=params(request_id, **request["lumen"]))
        engine.add_request(request_id, {"prompt_token_ids": request["prompt"]}, sampling)
    emitted: dict[str, dict[str, object]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            emitted[output.request_id] = {
                "tokens": list(output.outputs[0].token_ids),
                "num_cached_tokens": output.num_cached_tokens,
                "finish_reason": output.outputs[0].finish_reason,
            }
        print(PREFIX + json.dumps(emitted), flush=True)


if __name__ == "__main__":
    main()
