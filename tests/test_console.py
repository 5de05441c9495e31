"""emapg.console: library output goes to the run's log, our own lines stay on the console.

Real ``emapg eval`` and ``emapg train`` processes (tiny model, hf engine) are run with every kind of library noise
added inside the run -- a library logger, a ``FutureWarning``, ``print`` to stdout and stderr, a C-level write to
fd 2, a child process -- next to the real libraries' own output (transformers' "Loading weights" bar): the console
gets the progress lines and the results, none of the noise; the log gets all of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from emapg.paths import REPO_ROOT

# What libraries do: each kind of output a library may produce, marked LIB... so the test can find it.
NOISE = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings

    def noise():
        logging.getLogger("transformers.modeling_utils").warning("LIBWARN a transformers-style warning")
        logging.getLogger("vllm.engine").info("LIBINFO a vLLM-style info line")
        warnings.warn("LIBFUTURE a torch-style deprecation", FutureWarning)
        print("LIBPRINT a library's print")
        print("LIBSTDERR a library's bar", file=sys.stderr)
        os.write(2, b"LIBCLEVEL a C-level write\\n")
        subprocess.run([sys.executable, "-c", "import sys; print('LIBCHILD out'); print('LIBCHILD err', file=sys.stderr)"],
                       check=True)

    def noisy(real):
        def run(*args, **kwargs):
            noise()
            return real(*args, **kwargs)
        return run
""")
MARKERS = ("LIBWARN", "LIBINFO", "LIBFUTURE", "LIBPRINT", "LIBSTDERR", "LIBCLEVEL", "LIBCHILD out", "LIBCHILD err")
LIBRARY_LINE = re.compile(r"\b(INFO|WARNING|DEBUG)\b|FutureWarning|UserWarning|DeprecationWarning|LIB[A-Z]+|Loading weights")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NOISE + code, *map(str, args)], cwd=REPO_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _library_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if LIBRARY_LINE.search(line)]


def test_eval_console_has_the_results_and_the_log_has_the_library_output(tmp_path, tiny_model_dir, retriever_server):
    out = tmp_path / "eval"
    code = textwrap.dedent("""
        import eval.runner
        eval.runner.run_eval = noisy(eval.runner.run_eval)
        from app.cli import main
        sys.exit(main(["eval", *sys.argv[1:]]))
    """)
    p = _run(code, "--model", tiny_model_dir, "--suite", "qa", "--protocol", "qa_quick", "--datasets", "nq", "--limit", 2,
             "--retriever-url", retriever_server.url, "--engine", "hf", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| **average** |" in p.stdout and f"log: {out / 'eval.log'}" in p.stdout
    assert "eval nq 2/2 questions" in p.stderr  # the progress line (the output is not a terminal)
    assert _library_lines(p.stdout + p.stderr) == []
    log = (out / "eval.log").read_text()
    for marker in MARKERS:
        assert marker in log, marker
    assert "Loading weights" in log  # transformers' own bar, written by the real library
    assert "FutureWarning: LIBFUTURE" in log and "WARNING transformers.modeling_utils: LIBWARN" in log

    # a rerun (it resumes: nothing left to do) appends to the same log under its own header
    p = _run(code, "--model", tiny_model_dir, "--suite", "qa", "--protocol", "qa_quick", "--datasets", "nq", "--limit", 2,
             "--retriever-url", retriever_server.url, "--engine", "hf", "--out", out, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _library_lines(p.stdout + p.stderr) == [] and p.stderr == ""
    log = (out / "eval.log").read_text()
    assert log.count("===== ") == 2 and log.count("LIBCHILD err") == 2


def test_eval_says_on_the_console_when_it_fell_back_from_vllm(tmp_path, tiny_model_dir):
    """The reason (vLLM cannot be imported) is in the log; the console says which engine ran."""
    out = tmp_path / "eval"
    code = "sys.modules['vllm'] = None\nfrom app.cli import main\nsys.exit(main(['eval', *sys.argv[1:]]))"
    p = _run(code, "--model", tiny_model_dir, "--suite", "math", "--protocol", "math_quick", "--n", 1, "--max-tokens", 8,
             "--datasets", "aime2024", "--limit", 1, "--grader-workers", 1, "--engine", "vllm", "--no-progress", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.splitlines() == [f"emapg eval: ran on the hf engine, not vllm (see {out / 'eval.log'})"]
    assert "vLLM is not available" in (out / "eval.log").read_text()


def test_train_console_has_the_progress_and_the_log_has_the_library_output(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    code = textwrap.dedent("""
        import trainer.loop
        trainer.loop.train = noisy(trainer.loop.train)
        from app.cli import main
        sys.exit(main(["train", *sys.argv[1:]]))
    """)
    p = _run(code, "--config", REPO_ROOT / "configs" / "math_tiny_cpu.yaml", f"model.policy={tiny_model_dir}",
             f"run.output_dir={run}", "run.total_steps=2", "data.prompts_per_step=2", "algorithm.mini_batch_size=4",
             "rollout.max_tokens_per_turn=16", "rollout.max_response_tokens=16", "logging.tensorboard=false")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("finished step 2 of this session") and f"run folder: {run}" in p.stdout
    assert [line.split(" [")[0] for line in p.stderr.splitlines()] == ["train 1/2 steps", "train 2/2 steps"]
    assert _library_lines(p.stdout + p.stderr) == []
    log = (run / "train.log").read_text()
    for marker in MARKERS:
        assert marker in log, marker


def test_sft_console_has_its_lines_and_the_log_has_the_library_output(tmp_path, tiny_model_dir):
    import json

    import yaml

    from agent.actions import format_passages

    rows = []
    for i in range(8):
        passages = format_passages([{"contents": f'"Doc {i}"\nquestion {i}? The answer is a{i}.'}])
        rows.append({"question": f"question {i}?", "response": f"<search> question {i} </search>\n\n<information>"
                     f"{passages}</information>\n\n<answer> a{i} </answer>"})
    data = tmp_path / "trajs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"output_dir": str(run), "device": "cpu"}, "model": {"policy": str(tiny_model_dir)},
        "data": {"source": "file", "path": str(data), "exclude_eval_questions": False, "heldout_fraction": 0.25},
        "rollout": {"max_turns": 2, "max_tokens_per_turn": 96, "max_obs_tokens": 400, "max_response_tokens": 800,
                    "max_prompt_tokens": 512},
        "optim": {"epochs": 1, "batch_size": 2}}))
    code = textwrap.dedent("""
        import trainer.sft.train
        trainer.sft.train.run_sft = noisy(trainer.sft.train.run_sft)
        from app.cli import main
        sys.exit(main(["sft", *sys.argv[1:]]))
    """)
    p = _run(code, "--config", config)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("held-out SFT loss") and f"policy folder: {run / 'policy'}" in p.stdout
    assert "sft 3/3 steps" in p.stderr and "trainer.sft.train: held-out SFT loss before" in p.stderr  # our logger
    assert _library_lines(p.stdout + p.stderr) == []
    log = (run / "sft.log").read_text()
    for marker in MARKERS:
        assert marker in log, marker


def test_our_loggers_reach_the_console_and_a_crash_is_in_the_log_and_on_the_console(tmp_path):
    log = tmp_path / "out" / "x.log"
    code = textwrap.dedent(f"""
        from emapg.console import echo, library_output_to
        from emapg.progress import StepProgress
        try:
            with library_output_to({str(log)!r}, title="crash test"):
                noise()
                echo("OURS echo")
                logging.getLogger("trainer.loop").info("OURS resumed from step 3")
                logging.getLogger("agent.rollout").warning("OURS retrieval failed")
                p = StepProgress("work", 1)
                p.update(1, "x=1")
                p.close()
                raise RuntimeError("OURS boom")
        finally:
            print("OURS after")
    """)
    p = _run(code)
    assert p.returncode == 1
    assert p.stdout == "OURS after\n"
    err = p.stderr
    assert "OURS echo" in err and "trainer.loop: OURS resumed from step 3" in err
    assert "agent.rollout: warning: OURS retrieval failed" in err and "work 1/1 steps" in err
    assert f"(library output of this run: {log})" in err
    assert "Traceback" in err and "RuntimeError: OURS boom" in err  # the crash, as Python prints it, after the context
    assert not [m for m in MARKERS if m in err]
    text = log.read_text()
    assert all(m in text for m in MARKERS)
    assert "RuntimeError: OURS boom" in text and "OURS retrieval failed" in text  # our records are in the log too


def test_a_refused_command_leaves_no_folder_behind(tmp_path):
    from emapg.console import library_output_to
    from emapg.errors import UserError

    folder = tmp_path / "new"
    try:
        with library_output_to(folder / "eval.log", discard_unused=True):
            raise UserError("refused")
    except UserError:
        pass
    assert not folder.exists()

    existing = tmp_path / "existing"
    existing.mkdir()
    try:
        with library_output_to(existing / "eval.log", discard_unused=True):
            raise UserError("refused")
    except UserError:
        pass
    assert (existing / "eval.log").is_file()  # a folder the user had: the log stays


def test_help_names_the_log():
    from eval.cli import eval_parser
    from trainer.cli import _parser, sft_parser

    assert "DIR/eval.log" in " ".join(eval_parser().format_help().split())
    assert "<run.output_dir>/train.log" in " ".join(_parser().format_help().split())
    assert "<run.output_dir>/sft.log" in " ".join(sft_parser().format_help().split())
