"""The RQ worker that keeps models resident, and the energy meters it measures with."""
