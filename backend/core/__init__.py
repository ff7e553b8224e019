"""Who runs next: requests and their state, the scheduler that plans each step, and the paged KV
cache's blocks (allocation, prefix cache, swap). Nothing here touches a tensor."""
