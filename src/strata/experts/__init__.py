"""Expert tiers: routing traces and profiles, the default tier policy, replay, and the expert
store, pack and residency table."""
