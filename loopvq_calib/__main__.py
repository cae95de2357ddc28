"""``python -m loopvq_calib`` = ``loopvq-calibrate`` (for ``accelerate launch -m loopvq_calib ...``)."""

from .cli import calibrate

if __name__ == "__main__":
    calibrate.process()
