"""Reading the stream back: replay past runs under other schemes, monitors, tail, export, runs.

- `replay`: `replay_run`, the report of a run rebuilt by the trainer's adapter (`source`: reading a
  run group by group; `report`: rows and figures; `compare`: schemes side by side; `schemes`:
  scheme specs; `render` and `plot`: table/JSON/CSV and PNG; `schema`: the report's JSON Schema);
- `monitor`: the Python API for custom monitors (`Monitor`, `monitor_main`);
- `tail`, `export`, `runs`: the other commands' libraries; `cli`: the commands themselves.

See README.md beside this file.
"""
