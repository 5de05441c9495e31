"""What the OpenAI-compatible, recording endpoint costs (agent/engines/openai_endpoint.py), measured side by side.

1. **Endpoint vs native generate**: one generation server (``emapg engine serve``, transformers engine) on the
   scripted tiny tool-call searcher (agent/scripted_tools.py, so every call emits the same tool call and the
   two paths generate the same tokens); ``--clients`` threads send ``--requests`` single-prompt requests,
   through ``POST /generate`` (token ids, the trainer's path) or ``POST /v1/chat/completions`` with the search
   tool, a session id and log-probs (render, parse, record; each session deleted after its call), the same
   prompts and sampling, alternating over ``--rounds`` rounds (a shared machine is noisy: medians compared).
   Prints generated tokens/s of both and the ratio endpoint / native.
2. **External agent vs built-in agent**: the same model in this process, the same questions and seed, a real
   retriever server on the bundled index; the built-in tool-call loop (``rollout.format=tool_calls``) against
   examples/search_agent.py through ``rollout.agent`` (a loopback endpoint around the same engine), both
   ``max_turns=2`` (three model calls, two searches per trajectory). Prints trajectories/s and the ratio.

    python benchmarks/openai_endpoint.py [--requests 64] [--clients 8] [--rounds 5] [--questions 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "openai_endpoint.json"
KEY = "bench-key"
MAX_TOKENS = 32


def _models(work: Path) -> Path:
    from agent.scripted import save_scripted
    from agent.scripted_tools import TOOL_SEARCH_SCRIPT, build_tool_tiny
    from emapg.models import tiny_qwen2_folder

    tiny = tiny_qwen2_folder(work / "tiny")
    return save_scripted(build_tool_tiny(work / "tool-tiny", tiny), work / "searcher", TOOL_SEARCH_SCRIPT)


def _endpoint_vs_native(model: Path, args) -> dict:
    import httpx
    import openai
    from transformers import AutoTokenizer

    from agent.engines.launch import EngineServer
    from agent.formats import SEARCH_TOOL

    tok = AutoTokenizer.from_pretrained(model)
    questions = [f"question number {i}: what is the capital of country {i}?" for i in range(args.requests)]
    messages = [[{"role": "user", "content": q}] for q in questions]
    texts = [tok.apply_chat_template(m, tools=[SEARCH_TOOL], add_generation_prompt=True, tokenize=False) for m in messages]
    prompt_ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]  # what the endpoint renders
    params = {"temperature": 1.0, "top_p": 1.0, "max_tokens": MAX_TOKENS}
    with EngineServer(model, engine="hf", api_key=KEY, extra_args=["--max-wait-ms", "2"]) as server:
        http = httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

        def native(i: int) -> int:
            r = http.post(server.url + "/generate", json={"prompts": [prompt_ids[i]], "params": {**params, "seed": i}})
            r.raise_for_status()
            return len(r.json()["outputs"][0]["token_ids"])

        def endpoint(i: int) -> int:
            sid = f"bench-{uuid.uuid4().hex[:12]}"
            resp = client.chat.completions.create(model="m", messages=messages[i], tools=[SEARCH_TOOL], logprobs=True, seed=i,
                                                  extra_headers={"X-Session-Id": sid}, **params)
            assert resp.choices[0].message.tool_calls, "the scripted model should call the tool"
            http.delete(f"{server.url}/v1/sessions/{sid}")
            return resp.usage.completion_tokens

        def rate(fn) -> float:
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(args.clients) as pool:
                tokens = sum(pool.map(fn, range(args.requests)))
            return tokens / (time.perf_counter() - t0)

        rate(native), rate(endpoint)  # warm-up: both paths once
        rounds = {"native": [], "endpoint": []}
        for r in range(args.rounds):
            for name, fn in (("native", native), ("endpoint", endpoint)) if r % 2 == 0 else (("endpoint", endpoint), ("native", native)):
                rounds[name].append(rate(fn))
        http.close()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    ratio = med["endpoint"] / med["native"]
    print(f"endpoint vs native: native {med['native']:.1f} tok/s, endpoint {med['endpoint']:.1f} tok/s, "
          f"ratio endpoint/native {ratio:.3f} ({args.requests} requests, {args.clients} clients, {args.rounds} rounds)")
    return {"requests": args.requests, "clients": args.clients, "rounds": args.rounds, "max_tokens": MAX_TOKENS,
            "tokens_per_s": {k: [round(x, 2) for x in v] for k, v in rounds.items()},
            "median_tokens_per_s": {k: round(v, 2) for k, v in med.items()}, "endpoint_over_native": round(ratio, 4)}


def _external_vs_builtin(model: Path, args) -> dict:
    from agent.engines import make_engine
    from agent.rollout import RolloutConfig, run_rollouts
    from provision.indexes import ensure_bundled_index
    from retriever.client import RetrieverClient
    from retriever.launch import RetrieverServer
    from tasks.datasets import load_dataset

    questions = [ex.question for ex in load_dataset("nq", limit=args.questions)]
    engine = make_engine("hf", model, max_model_len=4096)
    # max_obs_tokens ~ what the example agent shows per search (2 passages cut to 300 characters): similar contexts.
    common = dict(max_turns=2, max_tokens_per_turn=MAX_TOKENS, topk=2, max_obs_tokens=400, max_response_tokens=3072,
                  seed=0, temperature=1.0, top_p=1.0)
    configs = {"builtin": RolloutConfig(format="tool_calls", **common),
               "external": RolloutConfig(agent="examples.search_agent:solve", agent_workers=8, **common)}
    out: dict = {"questions": len(questions), "trajectories_per_s": {}, "mean_response_tokens": {}, "mean_searches": {}}
    with RetrieverServer(ensure_bundled_index(), omp_num_threads=1) as server:
        retriever = RetrieverClient(server.url)
        for name, cfg in configs.items():
            run_rollouts(engine, questions[:2], retriever, cfg)  # warm-up
            rates = []
            for _ in range(max(1, args.rounds // 2)):
                t0 = time.perf_counter()
                trajs = run_rollouts(engine, questions, retriever, cfg)
                rates.append(len(trajs) / (time.perf_counter() - t0))
            assert all(t.stop_reason != "error" for t in trajs), [t.error for t in trajs if t.error][:2]
            out["trajectories_per_s"][name] = round(statistics.median(rates), 3)
            out["mean_response_tokens"][name] = round(sum(len(t.response_ids) for t in trajs) / len(trajs), 1)
            out["mean_searches"][name] = sum(t.num_searches for t in trajs) / len(trajs)
        retriever.close()
    r = out["trajectories_per_s"]
    out["external_over_builtin"] = round(r["external"] / r["builtin"], 4)
    print(f"external agent vs built-in: builtin {r['builtin']:.2f} traj/s, external {r['external']:.2f} traj/s, "
          f"ratio external/builtin {out['external_over_builtin']:.3f} (mean response tokens {out['mean_response_tokens']})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--skip-agents", action="store_true", help="only the endpoint vs native comparison")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(k, v)
    os.chdir(ROOT)  # examples/ importable for rollout.agent
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as work:
        model = _models(Path(work))
        result = {"benchmark": "openai_endpoint", "machine_cpus": os.cpu_count(),
                  "endpoint_vs_native": _endpoint_vs_native(model, args)}
        if not args.skip_agents:
            result["external_vs_builtin"] = _external_vs_builtin(model, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
