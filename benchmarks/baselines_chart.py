"""Bar chart of ``baselines.py`` results: tokens/s per system for each model and card, and the longest sequence.

Reads any number of the JSON files ``baselines.py`` writes (throughput runs and ``--max-seq`` runs alike)
and draws what they hold; a system without a number on a card gets no bar rather than a guessed one.

    python benchmarks/baselines_chart.py benchmarks/results/2026-11-29-baselines-*.json \\
        benchmarks/results/2026-11-29-maxseq-24gib-*.json --out benchmarks/results/2026-11-29-baselines-1.7b.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ORDER = (
    "plain", "roundpipe", "roundpipe-split", "roundpipe-split-tiled", "fsdp-offload", "zero2-offload", "zero3-offload"
)  # fmt: skip
"""Systems in the order they are drawn; ``roundpipe-split`` is roundpipe with ``--split-blocks``, and
``-tiled`` adds ``--tile-tokens``."""


def card(result: dict[str, Any], command: str = "") -> str:
    """The group a result is drawn in: the model shape and the card. Files written before results
    carried their model say it only in their command (and the 1.7B shape was the default)."""
    flag = re.search(r"--model\s+(\S+)", command)
    model = result.get("model") or (flag.group(1) if flag else "qwen3-1.7b")
    cap = result.get("gpu_cap_gib")
    return f"{model}, " + (f"{cap:g} GiB card" if cap else "full card")


def collect(paths: list[str]) -> tuple[dict[str, dict[str, float]], dict[str, tuple[int, int | None, bool, str]]]:
    """(tokens/s by model and card, then system; by system: the longest sequence that fit, the first that
    failed, whether the search narrowed the gap between them to its step, and the model and card). A
    ``single_probe`` result is one length that fit, with no search above it."""
    speed: dict[str, dict[str, float]] = {}
    longest: dict[str, tuple[int, int | None, bool, str]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        # files written before max-seq results carried the flag say it only in their command
        command = data.get("meta", {}).get("command", "")
        command = " ; ".join(command) if isinstance(command, list) else command  # some files ran several
        split_run = "--split-blocks" in command
        for r in data["results"]:
            if "error" in r:
                continue
            split = r["config"] == "roundpipe" and (r.get("split_blocks") or split_run)
            name = r["config"] + ("-split" if split else "") + ("-tiled" if split and r.get("tile_tokens") else "")
            if "max_seq_len" in r:
                done = not r.get("inconclusive") and not r.get("searching") and not r.get("single_probe")
                longest[name] = (r["max_seq_len"], r.get("first_failure"), done, card(r, command))
            elif "tokens_per_s" in r:
                speed.setdefault(card(r, command), {})[name] = r["tokens_per_s"]
    return speed, longest


def draw(speed: dict[str, dict[str, float]], longest: dict[str, tuple[int, int | None, bool, str]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6))
    cards = sorted(speed, key=lambda name: (name.split(", ")[0], "full card" not in name, name))  # full card first
    width = 0.8 / max(1, len(cards))
    timed = [s for s in ORDER if any(s in speed[name] for name in cards)]
    for i, name in enumerate(cards):
        xs = [k + i * width for k, system in enumerate(timed) if system in speed[name]]
        ys = [speed[name][system] for system in timed if system in speed[name]]
        bars = left.bar(xs, ys, width, label=name)
        left.bar_label(bars, labels=[f"{y / 1000:.1f}k" for y in ys], fontsize=7, rotation=90, padding=2)
    left.set_xticks([k + width * (len(cards) - 1) / 2 for k in range(len(timed))], timed, fontsize=8)
    left.set_ylabel("tokens/s (32 x 2048 per step)")
    left.set_title("Throughput")
    left.set_ylim(top=1.15 * max([y for systems in speed.values() for y in systems.values()], default=1))
    left.legend(fontsize=8)
    systems = [s for s in ORDER if s in longest]
    bars = right.bar(range(len(systems)), [longest[s][0] for s in systems], color="tab:green")

    def note(failed: int | None, done: bool) -> str:
        if done:
            return ""
        return "\n(longer not tried)" if failed is None else f"\n(fails at {failed:,};\nbetween not searched)"

    labels = [f"{fit:,}" + note(failed, done) for fit, failed, done, _ in (longest[s] for s in systems)]
    right.bar_label(bars, labels=labels, fontsize=7)
    right.set_xticks(range(len(systems)), [s.replace("-", "\n", 1) for s in systems], fontsize=8)
    right.set_ylabel("tokens in one sequence, micro-batch 1")
    right.set_title("Longest sequence that trains (" + ", ".join(sorted({c for _, _, _, c in longest.values()})) + ")")
    right.set_ylim(top=1.25 * max([fit for fit, _, _, _ in longest.values()], default=1))
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="JSON files written by baselines.py")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args()
    speed, longest = collect(args.results)
    for name, systems in speed.items():
        print(name, {k: round(v) for k, v in systems.items()})
    print("longest sequence", longest)
    draw(speed, longest, args.out)


if __name__ == "__main__":
    main()
