"""examples/train.py with a fault planted per asynchzp-ab arm, for the tool's failure test.

    _ab_faulty_train.py --die-arm ARM --marks DIR [train.py's arguments]

Under the arm named by --die-arm, rank 1 dies (exit 3) in its second optimizer step. Other arms train as
examples/train.py does. Each rank writes DIR/rank<N>.finally from a `finally` block around the script and
DIR/rank<N>.atexit from an exit handler, so the test sees what ran when the arm ended the script.
"""

import atexit
import json
import os
import runpy
import sys
from pathlib import Path

import deepspeed.runtime.engine as ds_engine


def _take(flag: str) -> str | None:
    if flag not in sys.argv:
        return None
    at = sys.argv.index(flag)
    value = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    return value


def main():
    die_arm = _take("--die-arm")
    marks = Path(_take("--marks"))
    marks.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: (marks / f"rank{rank}.atexit").write_text(os.environ.get("ASYNCHZP_AB_ARM", "")))
    config = json.loads(Path(sys.argv[sys.argv.index("--deepspeed_config") + 1]).read_text())
    arm = config["async_hzp_record"]["arm"]
    if arm == die_arm and os.environ.get("RANK") == "1":
        original, boundaries = ds_engine.DeepSpeedEngine.step, []

        def step(self, *args, **kwargs):
            if self.is_gradient_accumulation_boundary():
                boundaries.append(1)
                if len(boundaries) == 2:
                    os._exit(3)
            return original(self, *args, **kwargs)

        ds_engine.DeepSpeedEngine.step = step
    sys.argv[0] = str(Path(__file__).resolve().parents[1] / "examples" / "train.py")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        (marks / f"rank{rank}.finally").write_text("")


if __name__ == "__main__":
    main()
