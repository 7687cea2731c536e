"""The machinery behind ``helpers.launch``: learners never need to open these files.

The public surface is ``api``: notebooks and helpers/lessons use it and nothing else here (a contract in
pyproject.toml). Layers, top to bottom; a module imports only modules below it (another contract):
    magic        the %%torchrun cell magic, and %ranks / %%ranks
    live         live ranks: a launch whose workers run the cells the kernel sends them, each rank keeping its variables
    live_text    what live ranks tell the learner: their errors and messages (pure functions)
    api          launch / start / wait, Run, WorkerFailed, LaunchTimeout, and the launch server's start and stop
    spec         what a launch asks for, checked, as plain JSON
    processes    the kernel's handles on the server and the agents
    server       the launch server: imports torch once, forks an agent per launch
    agent        one torchrun agent (torch's own elastic launcher) driven from a spec
    console      labelled lines and progress: it only prints
    diagnosis    pure functions: which rank failed first, where each rank hangs
    bootstrap    the first code every worker runs (standard library and helpers.kit.run_files only)
    live_rank    the cell loop every live rank runs (worker side: standard library, torch and helpers.kit only)
    run_folder   reading back what a launch's workers and agents wrote (the file names: helpers.kit.run_files)
"""
