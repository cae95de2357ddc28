"""What several topics share: the checkout's paths, the words and tables of the results pages, the commit and device
a measurement records, and a quantizer without calibration."""
