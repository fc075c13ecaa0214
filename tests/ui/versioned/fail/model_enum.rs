use idem::Versioned;

// A row is a struct, not an enum: one error, at `enum`.
#[derive(Versioned)]
#[diesel(table_name = statuses)]
#[versioned(tenant = none, key = id)]
enum Status {
    Draft,
    Published,
}

fn main() {}
