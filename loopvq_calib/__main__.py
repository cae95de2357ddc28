"""``python -m loopvq_calib`` = ``loopvq-calibrate`` (for ``accelerate launch -m loopvq_calib ...``)."""

from .cli import calibrate_command

calibrate_command()
