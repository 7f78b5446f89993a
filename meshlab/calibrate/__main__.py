"""``python -m meshlab.calibrate`` (under torchrun): see meshlab.calibrate.main."""

from meshlab.calibrate import main

main()
