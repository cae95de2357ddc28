"""``python -m loopvq_calib`` = ``loopvq-calibrate`` (for ``accelerate launch -m loopvq_calib ...``)."""

import sys

from .cli import calibrate_main

sys.exit(calibrate_main())
