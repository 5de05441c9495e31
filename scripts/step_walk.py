"""How far one training step's batch travels: the files ``Trainer.learn`` enters, and the size of ``Trainer``.

Builds a run on the tiny preset (``configs/math_tiny_cpu.yaml``, tiny-qwen2, the transformers engine) with every
forward pass over the batch switched on -- π_old's statistics (two mini-batches), the anchor's statistics, the
distillation teacher (tiny-qwen2 in process), ``kl/to_start`` -- samples one batch, then records with
:func:`sys.setprofile` every call into a project file (not ``.venv``, not the standard library, not ``tests/``)
made while ``Trainer.learn`` consumes that batch.

The walk at depth D is the sequence of those calls made at most D frames below ``learn`` (``learn``'s own
calls are depth 1), each named by its file; consecutive calls into one file are one *stay*. A file's *entries*
count its stays; *returns* are stays in a file already left (stays − distinct files). A comprehension or generator
expression is part of the function that holds it, not a call of its own (Python 3.12 inlines comprehensions, PEP 709;
on 3.11 each is a frame, so a loop over trajectories that reads a property of another file between two comprehensions
would count as leaving its file and coming back; ``--count-comprehensions`` counts them the 3.11 way). The target of issue #56:
no file entered more than twice. Also printed: how often ``trainer/batch.py:micro_batches`` was called (the number
of separate walks over the batch), and ``Trainer``'s line count (its ``class`` statement to its last line).

    PYTHONPATH=$PWD .venv/bin/python scripts/step_walk.py [--depth 2] [--show] [--json out.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "configs" / "math_tiny_cpu.yaml"
#: Every pass over the batch on: two mini-batches (π_old's pass), the KL's anchor statistics, a teacher, kl/to_start.
ALL_PASSES = [
    "run.total_steps=1", "run.save_every=0", "logging.progress=false", "logging.tensorboard=false",
    "data.prompts_per_step=2", "rollout.n_samples=4", "rollout.max_tokens_per_turn=16", "rollout.max_response_tokens=16",
    "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4", "algorithm.kl.type=k3",
    "algorithm.distill.enabled=true", "algorithm.distill.teacher=tiny-qwen2", "algorithm.distill.mode=added",
    "logging.kl_to_start=true",
]


def class_lines(path: Path, name: str) -> int:
    """Lines of class ``name`` in ``path``: from its ``class`` statement to its last line."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise LookupError(f"no class {name} in {path}")


def project_file(filename: str) -> str | None:
    """``filename`` relative to the repository when it is one of the project's own source files."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] in (".venv", "tests") or rel.suffix != ".py":
        return None
    return str(rel)


#: The frames of comprehensions and generator expressions: parts of the function that holds them (see above).
INLINE = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})


def record_calls(fn, *args, comprehensions: bool = False) -> tuple[list[tuple[int, str, str]], object]:
    """``(depth below fn's frame, project file, function)`` of every Python call into a project file made by ``fn``;
    ``comprehensions``: count a comprehension's frame as a call (else it is part of its function: :data:`INLINE`)."""
    calls: list[tuple[int, str, str]] = []
    code = getattr(fn, "__func__", fn).__code__
    frames: list[bool] | None = None  # per open frame below fn's: whether it counts as a call (adds a level)

    def profile(frame, event, arg):
        nonlocal frames
        if event == "call":
            if frames is None:
                if frame.f_code is code:
                    frames = []
                return
            counted = comprehensions or frame.f_code.co_name not in INLINE
            frames.append(counted)
            rel = project_file(frame.f_code.co_filename)
            if counted and rel is not None:
                calls.append((sum(frames), rel, frame.f_code.co_name))
        elif event == "return" and frames is not None:
            if not frames:
                frames = None  # fn itself returned
            else:
                frames.pop()

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return calls, result


def walk(calls: list[tuple[int, str, str]], max_depth: int) -> list[str]:
    """The stays: files of the calls at depth <= ``max_depth``, consecutive repeats merged."""
    stays: list[str] = []
    for d, f, _ in calls:
        if d <= max_depth and (not stays or stays[-1] != f):
            stays.append(f)
    return stays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="more dotted overrides of the preset")
    parser.add_argument("--depth", type=int, default=2, help="the walk's depth below Trainer.learn (learn's own calls: 1)")
    parser.add_argument("--show", action="store_true", help="print the walk, one stay a line")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--count-comprehensions", action="store_true",
                        help="count each comprehension's and generator expression's frame as a call (Python 3.11's frames)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from emapg.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(TrainConfig, PRESET, [*ALL_PASSES, f"run.output_dir={tmp}", *args.overrides])
        trainer = Trainer(cfg).setup()
        try:
            sampled = trainer.sample_batch(trainer.sample_prompts())
            calls, _ = record_calls(trainer.learn, sampled, comprehensions=args.count_comprehensions)
        finally:
            trainer.close()
    out: dict[str, object] = {"trainer_class_lines": class_lines(ROOT / "trainer" / "loop.py", "Trainer"),
                              "micro_batches_calls": sum(1 for _, f, n in calls if f == "trainer/batch.py" and n == "micro_batches"),
                              "depths": {}}
    for depth in sorted({1, 2, 3, args.depth}):
        stays = walk(calls, depth)
        entries = Counter(stays)
        out["depths"][depth] = {"stays": len(stays), "files": len(entries), "returns": len(stays) - len(entries),
                                "most_entered": entries.most_common(5), "over_twice": sorted(f for f, c in entries.items() if c > 2)}
    print(f"Trainer: {out['trainer_class_lines']} lines; trainer/batch.py:micro_batches called {out['micro_batches_calls']} times in one learn()")
    for depth, d in out["depths"].items():
        print(f"depth <= {depth}: {d['stays']} stays in {d['files']} files, {d['returns']} returns; "
              f"entered more than twice: {len(d['over_twice'])} files; most entered: "
              + ", ".join(f"{f} x{c}" for f, c in d["most_entered"]))
    if args.show:
        for f in walk(calls, args.depth):
            print("  ", f)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
