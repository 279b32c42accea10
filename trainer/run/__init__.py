"""What a run trains and serves: the `train.toml` sections, the models, and the run spec they make.

- `sections`: one msgspec struct per section of `train.toml`, and `TrainConfig`, the whole file;
- `checks`: what msgspec's types cannot say (ranges, names, the GPU layout), each naming its key;
- `load`: `load_config` (a file) and `config_from_mapping` (parsed TOML) -> a checked `TrainConfig`;
- `models`: the models a run trains (`[model]`, each `[[policies]]`) and which agent goes to which;
- `spec`: the run spec those make (`schemas.runs.RunSpec`), what the trainer declares;
- `other_models`: the `[[policies]]` models trained beside `[model]` and the `[[frozen]]` ones
  served, each with its own engine.

The package itself imports nothing: import what you use from its modules.
"""
