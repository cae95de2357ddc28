"""``python -m loopvq_calib`` = ``loopvq-calibrate`` (for ``accelerate launch -m loopvq_calib ...``)."""

import sys

from .cli import calibrate_command

if __name__ == "__main__":
    sys.exit(calibrate_command())
