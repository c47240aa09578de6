"""How a run is launched: the strategy model and the one table of shipped strategies (`strategies`), the launch
commands (`commands`), the GPU a run is for (`devices`), nodes meeting before a launch (`rendezvous`) and the ranks
watched while they run (`watchdog`)."""
