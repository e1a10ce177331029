"""Pure formulas, shared by the runtime's "auto" and the tooling: memory per rank (`sizing`), bytes per flow and
per link (`traffic`), and the flow a collective belongs to (`flows`). No DeepSpeed, no torch."""
