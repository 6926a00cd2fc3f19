"""Tools around the engine that do not serve: :mod:`.make_model` writes random-weight GGUFs of real model shapes."""
