"""Build the demo corpus from the Python standard library's own source files on this machine:
real text, nothing downloaded, nothing copied into the repository. One JSON line per file."""

import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path

from tqdm import tqdm

if importlib.util.find_spec("megatron") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.config.parser import FlagParser, positive_float
from megatron.entry_point import run_entry_point

SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(path for path in root.rglob("*.py") if not SKIPPED_DIRS.intersection(path.relative_to(root).parts))


def main() -> None:
    run_entry_point(build)


def build() -> None:
    parser = FlagParser(description=__doc__)
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-megabytes", type=positive_float, default=8.0, help="stop after this much text")
    args = parser.parse_args()
    budget = int(args.max_megabytes * 2**20)
    written = files = 0
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as out, tqdm(stdlib_sources(), desc="corpus", unit="file") as bar:
        for path in bar:
            text = path.read_text(encoding="utf-8", errors="replace").strip()
            if not text:
                continue
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())
            files += 1
            if written >= budget:
                break
    print(f" > wrote {files} documents, {written / 2**20:.1f} MiB, to {args.output}")


if __name__ == "__main__":
    main()
