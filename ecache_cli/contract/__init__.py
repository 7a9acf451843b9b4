"""What several layers share, and nothing else: the decode state a policy reads and the step record it
observes (``state``), per-row fields (``rows``), and the hook surface between a policy and the model
(``hooks``). These modules import nothing of ecache beyond this package (docs/ARCHITECTURE.md)."""
