"""The loop of one worker and what it is made of: the trainer, the decisions the ranks take together
(agreement, divergence), running means and whole-split metrics, the checks of the first batch
(probe), the loaders of a rank, what a checkpoint holds and how a trainer is restored from it
(checkpoint_state), evaluation of a checkpoint, and the parts a trainer is built from."""
