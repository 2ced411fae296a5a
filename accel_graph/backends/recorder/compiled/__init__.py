"""Compiled replay for recorder graphs (``compile="inductor"``): the recorded program handed to
Inductor (:mod:`.inductor`), compiled in stretches around host steps (:mod:`.segmented`) and per
control-flow sub-program (:mod:`.control_flow`), the compile cache, frozen parameters, the
checked first run, the choice between compiled and interpreted replay, and what a torch's
Inductor cannot compile faithfully (:mod:`.precision_casts`, :mod:`.random_order`)."""
