"""What every part's command shares, wherever it runs: child processes that do not outlive their parent
(`child_processes`), settings loaded from a YAML file beneath the environment and listed for `--help`
(`command_settings`), and a started server's heap kept out of the collector's full passes (`heap`).

Both images ship `router/` (the replica's needs `router.policy`'s hashing; the router's runs the autoscaler), so
this is the one place the router, the autoscaler and the replica may all import; it imports none of them.
"""
