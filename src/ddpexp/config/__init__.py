"""Configuration: the typed schema in Hydra's ConfigStore (:mod:`.schema`), run dirs and the
resolvers that pick them (:mod:`.rundir`), checks of a composed config (:mod:`.validate`),
the command line before Hydra reads it (:mod:`.cli`), the monitored metric (:mod:`.monitor`),
config entries that name a class to build (:mod:`.components`), and a composed config for a
trainer built in-process (:mod:`.compose`)."""
