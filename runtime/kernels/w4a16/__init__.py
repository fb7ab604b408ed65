"""The W4A16 MoE kernel family as the runtime sees it: geometry shared with the build, specs, launch glue."""
