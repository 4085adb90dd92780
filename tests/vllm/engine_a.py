"""Engine A of the resume tests, run as its own process (its process group is SIGKILLed).

argv[1]: JSON {"model", "secret_file", "port", "prompts": {request_id: [token ids]},
"max_tokens"}. Serves every request through LumenConnector and prints, after every engine
step, one line PREFIX + JSON {request_id: [output token ids so far]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engines import engine_kwargs, params, transfer_config
from vllm import LLM, SamplingParams

# vLLM logs to stdout too: the parent reads only lines that start with this.
PREFIX = "emitted "


def main() -> None:
    job = json.loads(sys.argv[1])
    llm = LLM(
        **engine_kwargs(
            Path(job["model"]), kv_transfer_config=transfer_config(Path(job["secret_file"]), job["port"])
        )
    )
    engine = llm.llm_engine
    for request_id, prompt in job["prompts"].items():
        sampling = SamplingParams(
            max_tokens=job["max_tokens"], temperature=0.0, extra_args=params(request_id)
        )
        engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling)
    emitted: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            emitted[output.request_id] = list(output.outputs[0].token_ids)
        print(PREFIX + json.dumps(emitted), flush=True)


if __name__ == "__main__":
    main()
