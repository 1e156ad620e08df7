# Hydra reads this package's YAML files through importlib.resources (pkg://ddpexp.conf).
