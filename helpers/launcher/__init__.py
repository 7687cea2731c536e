"""The machinery behind ``helpers.launch``: learners never need to open these files.

Layers (every import points down; see each module's docstring):
    api          launch / start / wait, Run, WorkerFailed, LaunchTimeout: the public API, re-exported by helpers
    server       the launch server: imports torch once, forks an agent per launch
    agent        one torchrun agent (torch's own elastic launcher) driven from a spec
    processes    the kernel's handles on the server and the agents
    spec         what a launch asks for, checked, as plain JSON
    magic        the %%torchrun cell magic
    console      labelled lines and progress: it only prints
    diagnosis    pure functions: which rank failed first, where each rank hangs
    bootstrap    the first code every worker runs (standard library and run_folder only)
    run_folder   every file a launch writes and how it is read back (standard library only)
"""
