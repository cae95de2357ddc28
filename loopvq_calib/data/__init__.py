"""Text corpora: documents read from local files or hub datasets and cut into token windows, for
calibration (``data`` stage) and held-out evaluation alike.
"""
