"""How fast a recipe runs, before it runs: a step-time model of a training step (docs/speed.md).

Use: ``predict(step_work(spec, recipe, cluster=Cluster()), rates_for(...))`` (``speed.step_time``): compute from the
real step's ops traced on fake tensors (``census``), priced as a roofline times an efficiency per op class (``rates``);
the engine's collectives (``traffic``) on link tiers (``collectives``); the communication each engine hides behind
compute (``overlap``); the efficiencies and links fitted from benchmark records (``calibrate``).
"""
