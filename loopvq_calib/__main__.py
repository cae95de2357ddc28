"""``python -m loopvq_calib`` = ``loopvq-calibrate`` (for ``accelerate launch -m loopvq_calib ...``)."""

from .cli import calibrate_process

if __name__ == "__main__":
    calibrate_process()
