"""The engine core: scheduler, model runner and step loop, run in a process of their own.

`engine_core.EngineCore` is the step; `process` runs it for one API process; `records` are what
crosses between the two; `capacity` is the start-up self-benchmark the core runs on request.
"""
