// A rule is `From => [To, ..]`.
#[derive(Debug, Clone, PartialEq, idem::States)]
#[states(Pending -> Paid)]
enum OrderStatus {
    Pending,
    Paid,
}

fn main() {}
