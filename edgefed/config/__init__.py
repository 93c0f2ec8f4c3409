"""TOML config -> frozen dataclasses, validated once, with messages that name the key and how to fix it.

schema.py: the tables and their defaults (the keys are a contract); reading.py: files, `--set` overrides
and types; validation.py: ranges, choices, and the defaults that depend on other keys (policies.py: the
selection, privacy, FedBuff, secure aggregation and compression tables; checks.py: what every check is made
of); writing.py: the effective config as TOML (stored in every run log) and the comparison `--resume` makes.
"""

from edgefed.config.reading import (PATH_KEYS, absolute_paths, absolute_value, apply_override, config_from_dict,
                                    files_read, load_config, parse_toml, read_toml, set_key, stored_config)
from edgefed.config.schema import (ArrivalConfig, AwayConfig, Config, DataConfig, DepartureConfig, DeviceConfig, DynamicsConfig,
                                   FaultConfig, FedProxConfig, LogConfig, ModelConfig, MpiConfig, ParticipationConfig,
                                   ScaffoldConfig, TrainConfig)
from edgefed.config.validation import check_clients_per_round, validate, with_clients
from edgefed.config.schema import rank_timeout
from edgefed.config.writing import (dict_differences, log_differences, same_experiment, to_dict, to_toml,
                                   with_placement)

__all__ = ["PATH_KEYS", "absolute_paths", "absolute_value", "ArrivalConfig", "AwayConfig", "Config", "DataConfig", "DepartureConfig", "DeviceConfig", "DynamicsConfig", "FaultConfig", "FedProxConfig",
           "LogConfig", "ModelConfig", "MpiConfig", "ParticipationConfig", "ScaffoldConfig", "TrainConfig",
           "apply_override", "check_clients_per_round", "config_from_dict", "files_read", "load_config", "parse_toml", "read_toml",
           "dict_differences", "log_differences", "rank_timeout", "same_experiment", "set_key", "stored_config", "to_dict", "to_toml", "validate", "with_clients",
           "with_placement"]
