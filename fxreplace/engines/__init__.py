"""Engines: what runs the model fxreplace validates and blames. One package per engine
(:mod:`.embedded`, :mod:`.vllm`, :mod:`.vllm.neuron`) beside what they share
(:mod:`.protocol`, :mod:`.replacement`, :mod:`.recording`)."""
